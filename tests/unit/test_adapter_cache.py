"""The adapter's cache objects, layouts and arguments (:mod:`models.adapter`), and the
recurrent states :class:`models.kv_cache.KVCache` carries for it, on the CPU in float32."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from models.adapter import (
    AdapterArgs,
    KVLayout,
    ListLayout,
    SlotKVCache,
    SlotStateCache,
    StateLayout,
    UnsupportedCache,
    UnusedCache,
    UnusedLayout,
    decode,
    learn_layouts,
    prefill,
    verify,
)
from models.attention import cache_layout
from models.kv_cache import KVCache
from tests.parity.build import build_tiny
from tests.unit.test_adapter_parity import CONFIGS, tiny


@pytest.fixture(autouse=True)
def _cpu():
    with mx.stream(mx.cpu):
        yield


def _buffers(B: int, S: int, H: int = 1, D: int = 2) -> tuple[mx.array, mx.array]:
    return mx.zeros((B, H, S, D)), mx.zeros((B, H, S, D))


# -- SlotKVCache -------------------------------------------------------------------------------


def test_kv_writes_each_row_at_its_positions_linear():
    keys, values = _buffers(2, 8)
    offsets = mx.array([1, 4], mx.int32)
    cache = SlotKVCache(keys, values, offsets)
    new = mx.arange(2 * 3 * 2, dtype=mx.float32).reshape(2, 1, 3, 2) + 1
    k, _ = cache.update_and_fetch(new, new)
    for b, start in enumerate([1, 4]):
        assert mx.array_equal(k[b, 0, start : start + 3], new[b, 0])
        written = set(range(start, start + 3))
        assert all(mx.all(k[b, 0, j] == 0).item() for j in range(8) if j not in written)
    assert cache.offset.tolist() == [4, 7]
    assert offsets.tolist() == [1, 4]  # the caller's array is not changed


def test_kv_ring_writes_at_position_mod_size_for_one_token():
    keys, values = _buffers(2, 4)
    cache = SlotKVCache(keys, values, mx.array([9, 2], mx.int32), window=4)
    new = mx.ones((2, 1, 1, 2))
    k, _ = cache.update_and_fetch(new, new)
    assert k[0, 0, 9 % 4].tolist() == [1, 1] and k[1, 0, 2].tolist() == [1, 1]
    assert mx.sum(k).item() == 4  # nothing else written


@pytest.mark.parametrize(("window", "size", "n"), [(None, 8, 1), (None, 8, 3), (3, 8, 2), (4, 4, 1), (3, 8, 1)])
def test_kv_mask_is_always_the_shared_layout_array(window, size, n):
    keys, values = _buffers(2, size)
    offsets = mx.array([2, 5], mx.int32)
    cache = SlotKVCache(keys, values, offsets, window=window)
    mask = cache.make_mask(n)  # return_array left False: mlx-lm's would give None or "causal"
    positions = offsets[:, None] + mx.arange(n)[None, :]
    assert isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.shape == (2, 1, n, size)
    assert mx.array_equal(mask, cache_layout(positions, window, size)[1])


def test_kv_mask_window_size_argument_overrides():
    keys, values = _buffers(1, 8)
    cache = SlotKVCache(keys, values, mx.array([6], mx.int32))
    assert cache.make_mask(1, window_size=2)[0, 0, 0].tolist() == [j in (5, 6) for j in range(8)]
    assert cache.make_mask(1)[0, 0, 0].tolist() == [j <= 6 for j in range(8)]


# -- SlotStateCache ----------------------------------------------------------------------------


def test_state_cache_is_mlx_lm_arrays_cache_and_masks_padding():
    lengths = mx.array([2, 4], mx.int32)
    cache = SlotStateCache([None, None], lengths)
    assert isinstance(cache, ArraysCache) and cache.empty()
    mask = cache.make_mask(4)
    assert mask is not None and mask.tolist() == [[True, True, False, False], [True] * 4]
    cache[0] = mx.ones((2, 3))
    cache.advance(4)
    assert cache.lengths is not None and cache.lengths.tolist() == [-2, 0]
    assert lengths.tolist() == [2, 4]  # advance subtracts in place: the caller's array is kept
    mask = cache.make_mask(1)
    assert not cache.empty() and mask is not None and mask.tolist() == [[False], [False]]
    assert SlotStateCache([mx.zeros((2, 3))]).make_mask(1) is None  # decode: no padding


# -- KVCache with states -----------------------------------------------------------------------


def _with_states(B: int, C: int) -> KVCache:
    keys = [mx.arange(B, dtype=mx.float32).reshape(B, 1, 1, 1) * mx.ones((B, 1, C, 2))]
    states = [mx.arange(B, dtype=mx.float32).reshape(B, 1, 1) * mx.ones((B, 3, 2)), mx.arange(B, dtype=mx.int32)]
    return KVCache(keys, [k + 100 for k in keys], states)


def test_states_follow_rows_and_ignore_capacity():
    kv = _with_states(3, 4)
    assert kv.nbytes == 2 * 3 * 4 * 2 * 4 + 3 * 3 * 2 * 4 + 3 * 4
    moved = kv.reordered([2, 0, 1])
    assert moved.states[1].tolist() == [2, 0, 1] and moved.states[0][0, 0, 0].item() == 2
    grown = kv.resized(8)
    assert grown.capacity == 8 and all(g is s for g, s in zip(grown.states, kv.states, strict=True))
    padded = kv.batch_resized(5)
    assert padded.states[1].tolist() == [0, 1, 2, 0, 0] and padded.states[0].shape == (5, 3, 2)
    assert kv.batch_resized(2).states[1].tolist() == [0, 1]


def test_insert_rows_copies_states():
    dst = KVCache([mx.zeros((4, 1, 6, 2))], [mx.zeros((4, 1, 6, 2))], [mx.zeros((4, 3, 2)), mx.zeros((4,), mx.int32)])
    src = _with_states(3, 4)
    dst.insert_rows([3, 1], src, [2, 1], [4, 2])
    assert dst.states[1].tolist() == [0, 1, 0, 2]
    dst.insert_row(0, src, 2, 3)
    assert dst.states[1].tolist() == [2, 1, 0, 2] and dst.states[0][0, 0, 0].item() == 2


def test_a_cache_of_states_only():
    kv = KVCache([], [], [mx.zeros((2, 3))])
    assert (kv.batch, kv.capacity, kv.dtype) == (2, 0, mx.float32)
    dst = KVCache([], [], [mx.zeros((3, 3))])
    dst.insert_rows([2], KVCache([], [], [mx.ones((1, 3))]), [0], [7])
    assert dst.states[0].sum().item() == 3


# -- layouts and AdapterArgs -------------------------------------------------------------------


def test_layouts_of_attention_kinds():
    gemma = AdapterArgs.from_module(tiny(CONFIGS["gemma3_text"]))
    assert gemma.layouts == (KVLayout(2, 16, 16, 4), KVLayout(2, 16, 16, None))
    assert gemma.windows == (4, None) and not gemma.can_verify and gemma.vocab_size == 256
    mla = AdapterArgs.from_module(tiny(CONFIGS["deepseek_v3"]))
    assert all(isinstance(x, KVLayout) and x.heads == 1 and x.key_dim == 32 and x.value_dim == 8 for x in mla.layouts)
    assert mla.windows is None and mla.can_verify


def test_layouts_of_states_and_lists():
    nxt = AdapterArgs.from_module(tiny(CONFIGS["qwen3_next"]))
    assert isinstance(nxt.layouts[0], StateLayout) and isinstance(nxt.layouts[1], KVLayout)
    assert nxt.has_states and nxt.pads_prompts and not nxt.can_verify
    falcon = AdapterArgs.from_module(tiny(CONFIGS["falcon_h1"]))
    assert all(isinstance(x, ListLayout) for x in falcon.layouts)
    assert len(falcon.kv_layouts) == 2 and len(falcon.state_layouts) == 2
    assert not AdapterArgs.from_module(tiny(CONFIGS["mamba"])).pads_prompts  # mamba ignores lengths


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_next", "falcon_h1", "deepseek_v3"])
@pytest.mark.parametrize("ring", [True, False])
def test_kv_bytes_is_what_allocate_holds_per_row(model_type, ring):
    args = AdapterArgs.from_module(tiny(CONFIGS[model_type]))
    for capacity in (3, 16):
        kv = args.allocate(2, capacity, mx.float32, ring=ring)
        assert kv.batch == 2 and len(kv.keys) == len(args.kv_layouts)
        assert args.kv_bytes(capacity, 4, ring) * 2 == kv.nbytes
    per_layer = [args.kv_bytes(16, 4, ring, range(i, i + 1)) for i in range(args.num_hidden_layers)]
    assert sum(per_layer) == args.kv_bytes(16, 4, ring)


def test_allocate_rings_sliding_layers_in_decode_caches():
    args = AdapterArgs.from_module(tiny(CONFIGS["gemma3_text"]))
    assert [k.shape[2] for k in args.allocate(1, 16, mx.float32, ring=True).keys] == [4, 16]
    assert [k.shape[2] for k in args.allocate(1, 16, mx.float32).keys] == [16, 16]
    assert [k.shape[2] for k in args.allocate(1, 3, mx.float32, ring=True).keys] == [3, 3]


def test_unsupported_caches_are_named():
    model = tiny(CONFIGS["llama"])
    object.__setattr__(model, "make_cache", lambda: [RotatingKVCache(max_size=8, keep=4) for _ in range(2)])
    with pytest.raises(UnsupportedCache, match="keeps its first 4"):
        learn_layouts(model)


def test_unused_cache_entries_hold_nothing_and_refuse_use():
    """nemotron-nas gives a KVCache to a layer whose attention is a linear map: no buffers for
    it, and the stand-in the layer gets raises if anything reads it."""
    args = AdapterArgs.from_module(build_tiny("nemotron-nas"))
    assert UnusedLayout() in args.layouts and len(args.kv_layouts) == len(args.layouts) - 1
    with pytest.raises(UnsupportedCache, match="offset"):
        _ = UnusedCache().offset


def test_grouped_masks_only_where_the_scores_group_queries():
    assert AdapterArgs.from_module(build_tiny("gemma2")).grouped_mask  # scores [B, Hkv, repeats, L, S]
    assert not AdapterArgs.from_module(tiny(CONFIGS["llama"])).grouped_mask
    cache = SlotKVCache(mx.zeros((2, 1, 6, 4)), mx.zeros((2, 1, 6, 4)), mx.array([1, 3]), grouped=True)
    assert cache.make_mask(2).shape == (2, 1, 1, 2, 6)


def test_verify_refuses_rings_and_states():
    args = AdapterArgs.from_module(tiny(CONFIGS["gemma3_text"]))
    kv = args.allocate(1, 8, mx.float32, ring=True)
    with pytest.raises(ValueError, match="verify"):
        verify(args.module.parameters(), mx.zeros((1, 2), mx.int32), mx.zeros((1,), mx.int32), kv, args=args)


def test_the_module_keeps_its_real_parameters_after_compiled_steps():
    model = tiny(CONFIGS["qwen3"])
    before = tree_flatten(model.parameters())
    args = AdapterArgs.from_module(model)
    step = mx.compile(partial(prefill, args=args))
    logits, kv = step(
        model.parameters(), mx.array([[1, 2, 3]], mx.int32), mx.array([3], mx.int32), args.allocate(1, 3, mx.float32)
    )
    logits, _ = mx.compile(partial(decode, args=args))(
        model.parameters(), mx.array([4], mx.int32), mx.array([3], mx.int32), kv.resized(4)
    )
    mx.eval(logits)
    after = tree_flatten(model.parameters())
    assert [k for k, _ in after] == [k for k, _ in before]
    assert all(a is b for (_, a), (_, b) in zip(after, before, strict=True))
    mx.eval(model(mx.array([[1]], mx.int32)))  # placeholders left in the module would fail here
