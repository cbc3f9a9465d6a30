"""The parts of mlx-lm's cache protocol :mod:`models.adapter` relies on. A failure here means
the pinned mlx-lm changed under the adapter: read the new ``mlx_lm/models/cache.py`` and
``base.py`` before changing the pin."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.models import base, gemma3_text
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

from models.adapter import SlotKVCache
from tests.unit.test_adapter_parity import CONFIGS, tiny

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cpu():
    with mx.stream(mx.cpu):
        yield


def test_the_installed_mlx_lm_is_the_pinned_one():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [m.group(1) for d in deps if (m := re.fullmatch(r"mlx-lm==(\S+)", d))]
    assert pins == [mlx_lm.__version__]


class _Recorder:
    """A cache that records how ``make_mask`` was called."""

    def __init__(self):
        self.calls: list[tuple[tuple, dict]] = []

    def make_mask(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "mask"


def test_attention_masks_come_from_the_cache_with_its_arguments():
    h = mx.zeros((2, 3, 8))
    cache = _Recorder()
    assert base.create_attention_mask(h, cache, window_size=4, return_array=True) == "mask"
    assert cache.calls == [((3,), {"return_array": True, "window_size": 4})]
    assert base.create_ssm_mask(h, cache) == "mask"
    assert cache.calls[-1] == ((3,), {})


def test_mlx_lm_own_masks_would_be_wrong_in_a_fixed_buffer():
    """Why the adapter always returns an array: mlx-lm's plain KV cache gives no mask for one
    token and "causal" for several (right only when the keys are exactly the filled ones)."""
    h1, h3 = mx.zeros((1, 1, 8)), mx.zeros((1, 3, 8))
    assert base.create_attention_mask(h1, KVCache()) is None
    assert base.create_attention_mask(h3, KVCache()) == "causal"


def test_quantized_attention_is_chosen_by_a_bits_attribute():
    q = k = v = mx.ones((1, 1, 2, 4))
    keys, values = mx.zeros((1, 1, 4, 4)), mx.zeros((1, 1, 4, 4))
    slot = SlotKVCache(keys, values, mx.zeros((1,), mx.int32))
    assert not hasattr(slot, "bits")
    out = base.scaled_dot_product_attention(q, k, v, cache=slot, scale=1.0, mask=None)
    assert mx.allclose(out, mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0)).item()


def test_arrays_cache_protocol():
    cache = ArraysCache(2)
    assert cache.cache == [None, None] and cache.lengths is None and cache.left_padding is None
    cache[1] = mx.ones((2, 3))
    assert cache[1].shape == (2, 3) and cache.cache[1] is cache[1]
    assert cache.make_mask(2) is None
    cache.lengths = mx.array([1, 2])
    mask = cache.make_mask(2)
    assert mask is not None and mask.tolist() == [[True, False], [True, True]]
    cache.advance(2)
    assert cache.lengths is not None and cache.lengths.tolist() == [-1, 0]


def test_cache_list_and_kv_cache_attributes():
    kv, rot = KVCache(), RotatingKVCache(max_size=4)
    assert rot.max_size == 4 and rot.keep == 0
    pair = CacheList(ArraysCache(1), kv)
    assert pair.caches[1] is kv and pair[1] is kv
    keys = mx.zeros((1, 2, 3, 5))
    kv.update_and_fetch(keys, mx.zeros((1, 2, 3, 7)))
    assert kv.keys is not None and kv.values is not None
    assert (kv.keys.shape[1], kv.keys.shape[3], kv.values.shape[3], kv.offset) == (2, 5, 7, 3)


def test_make_prompt_cache_defers_to_the_model():
    plain = nn.Module()
    plain.layers = [nn.Linear(2, 2) for _ in range(3)]
    assert [type(c) for c in make_prompt_cache(plain)] == [KVCache] * 3  # no make_cache: one KVCache a layer
    gemma = tiny(CONFIGS["gemma3_text"])
    assert isinstance(gemma, gemma3_text.Model)
    caches = make_prompt_cache(gemma)
    assert [type(c) for c in caches] == [type(c) for c in gemma.make_cache()]
    assert isinstance(caches[0], RotatingKVCache) and caches[0].max_size == 4


def test_rope_takes_one_offset_per_row():
    x = mx.random.normal((2, 2, 3, 8))
    offsets = mx.array([0, 5], mx.int32)
    both = mx.fast.rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=offsets)
    for b, offset in enumerate([0, 5]):
        alone = mx.fast.rope(x[b : b + 1], 8, traditional=False, base=10000.0, scale=1.0, offset=offset)
        assert mx.allclose(both[b : b + 1], alone, atol=1e-6).item()
