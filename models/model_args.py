"""The hyper-parameters of a Llama-family decoder (:class:`ModelArgs`), read from a
``config.json`` whose math-changing keys are each implemented or refused, and the RoPE each
layer uses. The architectures' own ``ModelArgs`` (qwen2, gemma3_text, qwen3_moe) extend it."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, ClassVar, Self

from models.config_check import Supports, unimplemented_config
from models.kv_cache import layer_sizes
from models.rope import RoPE, make_rope, rope_type

#: Keys a ``config.json`` must have: without them the model's shape is unknown (mlx-lm's
#: llama.ModelArgs requires the same ones).
REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "rms_norm_eps",
    "vocab_size",
)


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of a Llama-family decoder.

    Field names follow the Hugging Face / mlx-lm ``config.json`` convention so that
    :meth:`from_dict` takes such a config unchanged. ``rope_traditional`` selects MLX's
    interleaved RoPE (pairs ``(2i, 2i+1)``), which is the layout of Q/K rows in llama.cpp
    GGUF files (convert_hf_to_gguf.py permutes them); the Hugging Face layout uses the
    non-interleaved form (``False``). ``rope_scaling`` is the checked scaling dict as sorted
    ``(key, value)`` pairs (hashable; :mod:`models.rope`); ``layer_types`` names each layer
    ``full_attention`` or ``sliding_attention`` (a window of ``sliding_window`` positions).
    Architectures that extend it (gemma3_text, qwen3_moe) subclass it and override
    :meth:`rope`, :attr:`attention_scale`, :attr:`supports` or :meth:`_values`.
    """

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    model_type: str = "llama"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    head_dim: int | None = None
    quant_group_size: int = 32
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None

    #: What the architecture implements of the keys models.config_check checks.
    supports: ClassVar[Supports] = Supports(sliding_layer_types=True)
    #: Keys its config.json must carry.
    required: ClassVar[tuple[str, ...]] = REQUIRED_KEYS

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Self:
        """Build from a ``config.json`` dict.

        Keys that do not change the computation are ignored (mlx-lm's convention); keys
        that would change it in a way stepserve does not implement are refused
        (:func:`models.config_check.unimplemented_config`). ``num_key_value_heads``
        defaults to ``num_attention_heads`` (Hugging Face's default), ``rope_theta`` and the
        RoPE scaling may be nested under ``rope_parameters`` (transformers >= 5, whose
        values win, as transformers' ``convert_rope_params_to_dict`` does), and the
        quantization group size comes from ``quantization.group_size`` (mlx-lm's format).

        Raises:
            ValueError: a required key is missing, or the config asks for something not
                implemented; the message names every such key and value.
        """
        config = cls._complete(config)
        problems = [f"'{k}' is missing (required)" for k in cls.required if config.get(k) is None]
        problems += unimplemented_config(config, cls.supports)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(**cls._values(config))

    @classmethod
    def _complete(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The config with what the architecture derives before checking (default: as is)."""
        return config

    @classmethod
    def _values(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Constructor arguments from a checked config."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in config.items() if k in names and v is not None}
        values.setdefault("num_key_value_heads", config["num_attention_heads"])
        rope = config.get("rope_parameters") or {}
        if "rope_theta" in rope:  # transformers >= 5: rope_parameters wins over a top-level rope_theta
            values["rope_theta"] = rope["rope_theta"]
        scaling = config.get("rope_scaling") or rope
        values["rope_scaling"] = None if rope_type(scaling) == "default" else scaling_items(scaling)
        if config.get("layer_types") is not None:
            values["layer_types"] = tuple(config["layer_types"])
        if isinstance(config.get("quantization"), dict):
            values["quant_group_size"] = config["quantization"].get("group_size", 64)
        return values

    @property
    def dim_per_head(self) -> int:
        """D: the attention head dimension (``head_dim`` or hidden_size / heads)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def attention_scale(self) -> float:
        """1/sqrt(D), the scaled dot-product attention scale (Vaswani et al. 2017)."""
        return 1.0 / math.sqrt(self.dim_per_head)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window in positions, or None (full attention)."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def windows(self) -> tuple[int | None, ...] | None:
        """Every layer's :meth:`window`, or None when no layer slides (a plain linear cache)."""
        windows = tuple(self.window(i) for i in range(self.num_hidden_layers))
        return windows if any(w is not None for w in windows) else None

    # What the engine asks of any model's args (the same names as models.adapter.AdapterArgs).

    @property
    def can_verify(self) -> bool:
        """Whether the architecture's ``verify`` step serves it: no sliding-window rings."""
        return self.windows is None

    @property
    def has_states(self) -> bool:
        """Never: a hand-written architecture keeps no recurrent state."""
        return False

    @property
    def pads_prompts(self) -> bool:
        """Always: a prompt row may be right-padded (attention masks the padding)."""
        return True

    @property
    def prefix_blocks(self) -> bool:
        """Always: the prefix cache can keep this model's prompt blocks."""
        return True

    def rope(self, layer: int) -> RoPE:
        """Layer ``layer``'s rotary embedding (the same for every layer here)."""
        return cached_rope(self.dim_per_head, self.rope_theta, self.rope_traditional, self.rope_scaling)

    def kv_bytes(self, capacity: int, itemsize: int, ring: bool = True, layers: range | None = None) -> int:
        """Bytes of one row's KV cache at ``capacity`` positions: keys and values of every
        layer (or of ``layers``, a pipeline stage's), Hkv x D x ``itemsize`` per position,
        sliding layers holding min(W, C) positions when ``ring`` (a decode cache), C otherwise
        (prefill and staging caches)."""
        sizes = layer_sizes(self.num_hidden_layers, capacity, self.windows if ring else None)
        if layers is not None:
            sizes = sizes[layers.start : layers.stop]
        return 2 * sum(sizes) * self.num_key_value_heads * self.dim_per_head * itemsize


def scaling_items(scaling: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A RoPE scaling dict as sorted pairs, without the base (``rope_theta``, read apart)."""
    return tuple(sorted((k, v) for k, v in scaling.items() if k != "rope_theta"))


@lru_cache(maxsize=64)
def cached_rope(dims: int, base: float, traditional: bool, scaling: tuple[tuple[str, Any], ...] | None) -> RoPE:
    """:func:`models.rope.make_rope` for hashable arguments, computed once per model."""
    return make_rope(dims, base, traditional, dict(scaling) if scaling else None)
