"""Build the tiny random mlx-lm models of `tiny_configs` and classify their caches."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as cache_lib

from tests.parity.tiny_configs import TINY_CONFIGS

# mlx-lm cache classes -> CACHE_KIND word (see tiny_configs.CACHE_KIND).
_KIND_OF_CACHE: dict[type, str] = {
    cache_lib.KVCache: "kv",
    cache_lib.RotatingKVCache: "sliding",
    cache_lib.ArraysCache: "state",
    cache_lib.CacheList: "list",
}


#: `build_tiny` overrides for heads of 64 values, the group `kv_bits` quantizes (the tiny configs'
#: heads are 16): 4 query heads over 2 key-value heads of 64, a residual width of 256 (so the
#: modules that derive the head dim from it, as phi3 and olmo2, get 64 too).
WIDE_HEADS: dict[str, Any] = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64
)


def build_tiny(name: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """The tiny random model of mlx-lm architecture module `name`, float32, parameters evaluated.

    `name` is a key of `TINY_CONFIGS` (an `mlx_lm.models` module name); `overrides` replace keys
    of its config (e.g. wider heads: `head_dim=64`). Parameters are drawn by
    the module's own initialisers after `mx.random.seed(seed)`, so two calls with the same seed
    give the same weights. Raises KeyError for an unknown name and whatever the module raises
    for a config it rejects.
    """
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict({**TINY_CONFIGS[name], **overrides}))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _entry_kind(entry: Any) -> str:
    """The CACHE_KIND word of one layer's cache entry after a forward (see `cache_kind`)."""
    if type(entry) is cache_lib.KVCache:
        keys, values = entry.keys, entry.values
        if keys is not None and values is not None and keys.shape[-1] != values.shape[-1]:
            return "mla"
        return "kv"
    for cls, word in _KIND_OF_CACHE.items():
        if isinstance(entry, cls):
            return word
    return f"quirk:{type(entry).__name__}"


def cache_kind(model: nn.Module) -> str:
    """Classify `model`'s mlx-lm prompt cache: the sorted, '+'-joined set of per-layer kinds.

    A one-token forward fills the cache made by `mlx_lm.models.cache.make_prompt_cache(model)`;
    each layer's entry is then "kv" (KVCache whose keys and values share a head dim), "mla"
    (KVCache with different key and value head dims, multi-head latent attention), "sliding"
    (RotatingKVCache), "state" (ArraysCache: conv / recurrent state), "list" (CacheList) or
    "quirk:<class name>" for any other class (e.g. llama4's ChunkedKVCache).
    """
    prompt_cache = cache_lib.make_prompt_cache(model)
    mx.eval(model(mx.array([[1]]), cache=prompt_cache))
    return "+".join(sorted({_entry_kind(c) for c in prompt_cache}))
