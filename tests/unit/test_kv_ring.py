"""The decode cache's rings for sliding-window layers: each index holds the latest position
written there, a linear prefill row is copied into the ring layout, bucket moves leave a full
ring as it is, and the memory formula counts a ring's window rather than the capacity."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from models import gemma3_text
from models.kv_cache import KVCache, layer_sizes, ring_positions
from models.loader import LoadedModel
from service.process.memory import decode_row_bytes, kv_bytes_per_position
from tests.support import tiny_config

WINDOWS = (4, None)  # layer 0 slides over 4 positions, layer 1 is global


def positions_cache(length: int, capacity: int) -> KVCache:
    """A linear batch-1 cache of 2 layers whose keys and values at position p hold the value p."""
    row = mx.broadcast_to(mx.arange(capacity, dtype=mx.float32)[None, None, :, None], (1, 1, capacity, 2))
    row = mx.where(mx.arange(capacity)[None, None, :, None] < length, row, -1.0)
    return KVCache([row, row], [row, row])


def test_ring_positions_are_the_latest_written_at_each_index():
    assert ring_positions(3, 4) == [0, 1, 2, 0]  # not wrapped: index 3 unwritten
    assert ring_positions(4, 4) == [0, 1, 2, 3]
    assert ring_positions(10, 4) == [8, 9, 6, 7]  # positions 6..9 at p mod 4


def test_sizes_stop_growing_at_the_window():
    assert layer_sizes(2, 2, WINDOWS) == [2, 2]
    assert layer_sizes(2, 16, WINDOWS) == [4, 16]
    assert layer_sizes(2, 16, None) == [16, 16]


def test_a_linear_row_is_copied_into_a_ring_and_survives_bucket_moves():
    decode = KVCache.allocate(2, 2, 1, 8, 2, mx.float32, WINDOWS)
    assert [k.shape[2] for k in decode.keys] == [4, 8] and decode.capacity == 8
    decode.insert_row(1, positions_cache(7, 8), 0, 7)  # positions 0..6: the ring holds 4..6 and 3
    assert decode.keys[0][1, 0, :, 0].tolist() == [4, 5, 6, 3]
    assert decode.values[1][1, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, -1]
    grown = decode.resized(16, WINDOWS)  # a capacity move: the ring is left as it is
    assert [k.shape[2] for k in grown.keys] == [4, 16]
    assert grown.keys[0] is decode.keys[0]
    assert grown.resized(8, WINDOWS).keys[1][1, 0, :, 0].tolist() == decode.keys[1][1, 0, :, 0].tolist()


def test_a_short_row_fills_a_small_ring_in_place():
    decode = KVCache.allocate(2, 1, 1, 2, 2, mx.float32, WINDOWS)  # capacity 2 < window: ring of 2
    decode.insert_row(0, positions_cache(1, 4), 0, 1)
    assert decode.keys[0][0, 0, :, 0].tolist() == [0, -1]
    grown = decode.resized(8, WINDOWS)  # from 2 to the window of 4: positions stay at their index
    assert grown.keys[0][0, 0, :, 0].tolist() == [0, -1, 0, 0]


def test_the_memory_formula_counts_the_rings():
    args = gemma3_text.ModelArgs.from_dict(tiny_config("gemma3_text"))  # window 8, layers 0 and 2 slide
    model = LoadedModel("tiny", Path("-"), args, {}, None, mx.float32, "dequantized", 0.0)  # type: ignore[arg-type]
    per_layer_position = 2 * args.num_key_value_heads * args.dim_per_head * 4  # keys and values, float32
    assert kv_bytes_per_position(model) == 4 * per_layer_position  # prefill and staging caches are linear
    assert decode_row_bytes(model, 4) == 4 * 4 * per_layer_position
    assert decode_row_bytes(model, 256) == (2 * 256 + 2 * 8) * per_layer_position
    kv = KVCache.allocate(4, 1, args.num_key_value_heads, 256, args.dim_per_head, mx.float32, args.windows)
    assert kv.nbytes == decode_row_bytes(model, 256)
