"""Paged KV primitives on the CPU: writing rows through random block tables (shared blocks,
non-contiguous ids, null-block padding) and gathering them back gives a static cache's contents,
and attention through a pool and its tables equals :class:`models.attention.CacheAttention` on
the static cache, under one compiled function fed two different tables."""

from __future__ import annotations

import random
from typing import cast

import mlx.core as mx
import pytest

from models.attention import CacheAttention, kv_roundtrip
from models.paged import (
    PagedAttention,
    PagedKV,
    Quantized,
    QuantizedPagedAttention,
    copy_blocks,
    gather,
    gather_quantized,
    paged_index,
    quantized_pool,
    write,
    write_quantized,
)

BT, N, HQ, HKV, D = 4, 24, 4, 2, 8  # block tokens, pool blocks, query and key-value heads, head dim
LENGTHS = [9, 13, 3]  # positions each row holds before the step
SHARED = 2  # rows 0 and 1 share their first 2 blocks (8 positions)
M = 5  # table columns: room for every row's blocks after a 4-token chunk
SCALE = D**-0.5


def tables(rng: random.Random, lengths: list[int], extra: int) -> mx.array:
    """int32 [B, M]: each row gets distinct, shuffled block ids for ``length + extra`` positions
    (rows 0 and 1 share their first :data:`SHARED` blocks), padded with the null block 0."""
    ids = rng.sample(range(1, N), N - 1)
    rows = []
    for b, length in enumerate(lengths):
        need = -(-(length + extra) // BT)
        row = (
            rows[0][:SHARED] + [ids.pop() for _ in range(need - SHARED)] if b == 1 else [ids.pop() for _ in range(need)]
        )
        rows.append(row)
    return mx.array([row + [0] * (M - len(row)) for row in rows], mx.int32)


def static_cache(seed: int, lengths: list[int]) -> tuple[mx.array, mx.array]:
    """Random keys and values [B, Hkv, M * bt, D]; rows 0 and 1 agree on their shared positions."""
    mx.random.seed(seed)
    keys, values = (mx.random.normal((len(lengths), HKV, M * BT, D)) for _ in range(2))
    shared = SHARED * BT
    keys[1, :, :shared] = keys[0, :, :shared]
    values[1, :, :shared] = values[0, :, :shared]
    return keys, values


def pooled(table: mx.array, keys: mx.array, lengths: list[int]) -> mx.array:
    """A pool holding each row's positions 0..length-1 of ``keys``, written through ``table`` in
    one batched write of every row's M * bt positions (the ones past a row's length are padding:
    in its last block or the null block)."""
    B = len(lengths)
    positions = mx.broadcast_to(mx.arange(M * BT, dtype=mx.int32)[None], (B, M * BT))
    valid = positions < mx.array(lengths)[:, None]
    # padding writes zeros (into the row's own last block or the null block): a test that
    # reads a padded slot as a real one fails
    return write(mx.zeros((N, HKV, BT, D)), table, positions, mx.where(valid[:, None, :, None], keys, 0.0))


def test_write_then_gather_reads_back_a_static_cache():
    keys, _ = static_cache(0, LENGTHS)
    for seed in range(4):
        table = tables(random.Random(seed), LENGTHS, 0)
        view = gather(pooled(table, keys, LENGTHS), table)
        assert view.shape == (len(LENGTHS), HKV, M * BT, D)
        for b, length in enumerate(LENGTHS):
            assert mx.array_equal(view[b, :, :length], keys[b, :, :length]), (seed, b)


def test_write_lands_in_the_tables_blocks_only():
    keys, _ = static_cache(1, LENGTHS)
    table = tables(random.Random(0), LENGTHS, 0)
    pool = pooled(table, keys, LENGTHS)
    used = set(cast(list[int], table.flatten().tolist()))
    untouched = [n for n in range(N) if n not in used]
    assert untouched and mx.array_equal(pool[mx.array(untouched)], mx.zeros((len(untouched), HKV, BT, D)))
    # a shared block is the one both rows see
    assert table[0, 1].item() == table[1, 1].item()
    assert mx.array_equal(pool[table[1, 1].item()], keys[1, :, BT : 2 * BT])


def step(table, positions, q, k, v, pool_keys, pool_values, window):
    return PagedAttention(table, positions, SCALE)(window)(q, k, v, pool_keys, pool_values)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("chunk", [1, 4])
def test_attention_through_the_pool_equals_the_static_cache_under_one_compiled_step(window, chunk):
    keys, values = static_cache(2, LENGTHS)
    mx.random.seed(3)
    B = len(LENGTHS)
    q = mx.random.normal((B, HQ, chunk, D))
    k, v = mx.random.normal((B, HKV, chunk, D)), mx.random.normal((B, HKV, chunk, D))
    positions = mx.array(LENGTHS, mx.int32)[:, None] + mx.arange(chunk, dtype=mx.int32)[None]  # [B, L]
    want, want_keys, _ = CacheAttention(positions, SCALE)(window)(q, k, v, keys, values)

    traces = []

    def traced(table, positions, q, k, v, pool_keys, pool_values):
        traces.append(1)  # Python runs only while tracing
        return step(table, positions, q, k, v, pool_keys, pool_values, window)

    compiled = mx.compile(traced)
    for seed in (10, 11):
        table = tables(random.Random(seed), LENGTHS, chunk)
        got, pool_keys, _ = compiled(
            table, positions, q, k, v, pooled(table, keys, LENGTHS), pooled(table, values, LENGTHS)
        )
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5), (seed, mx.abs(got - want).max().item())
        view = gather(pool_keys, table)
        for b, length in enumerate(LENGTHS):
            assert mx.array_equal(view[b, :, : length + chunk], want_keys[b, :, : length + chunk])
    assert len(traces) == 1  # one trace served both tables: the table is an input, not a constant


def test_a_wrong_table_gives_a_wrong_answer():
    keys, values = static_cache(4, LENGTHS)
    mx.random.seed(5)
    B = len(LENGTHS)
    q, k, v = mx.random.normal((B, HQ, 1, D)), mx.random.normal((B, HKV, 1, D)), mx.random.normal((B, HKV, 1, D))
    positions = mx.array(LENGTHS, mx.int32)[:, None]
    want, _, _ = CacheAttention(positions, SCALE)(None)(q, k, v, keys, values)
    table = tables(random.Random(6), LENGTHS, 1)
    pool_keys, pool_values = pooled(table, keys, LENGTHS), pooled(table, values, LENGTHS)
    got, _, _ = step(table, positions, q, k, v, pool_keys, pool_values, None)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5)
    # full attention does not see the order of the positions it attends to, so the wrong table
    # reads another row's block: row 0's block 1 replaced by row 2's block 0
    wrong_table = mx.array(table)
    wrong_table[0, 1] = table[2, 0]
    wrong, _, _ = step(wrong_table, positions, q, k, v, pool_keys, pool_values, None)
    assert not mx.allclose(wrong[0], want[0], atol=1e-3, rtol=0)
    assert mx.allclose(wrong[2], want[2], atol=1e-5, rtol=1e-5)  # the other rows are untouched


def test_copy_blocks_is_the_copy_on_write():
    mx.random.seed(7)
    kv = PagedKV([mx.random.normal((N, HKV, BT, D))], [mx.random.normal((N, HKV, BT, D))])
    before = mx.array(kv.keys[0])
    copied = kv.copied(mx.array([3, 5], mx.int32), mx.array([9, 1], mx.int32))
    assert mx.array_equal(copied.keys[0][9], before[3]) and mx.array_equal(copied.values[0][1], kv.values[0][5])
    rest = mx.array([n for n in range(N) if n not in (9, 1)])
    assert mx.array_equal(copied.keys[0][rest], before[rest])
    assert mx.array_equal(kv.keys[0], before)  # the input pool is not changed
    assert mx.array_equal(copy_blocks(before, mx.array([0]), mx.array([2]))[2], before[0])


def test_allocate_shapes():
    kv = PagedKV.allocate(layers=3, num_blocks=N, kv_heads=HKV, block_tokens=BT, head_dim=D, dtype=mx.float16)
    assert len(kv.keys) == 3 and kv.keys[0].shape == (N, HKV, BT, D) and kv.block_tokens == BT
    assert kv.num_blocks == N and kv.nbytes == 2 * 3 * N * HKV * BT * D * 2


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_attention_equals_the_static_cache_of_the_dequantized_values(bits):
    """kv_bits storage: attention over the quantized pool equals attention over a static cache
    holding what the quantization keeps (to float32 rounding), and 8 bits stays close to the
    unquantized answer."""
    Dq, lengths = 64, LENGTHS
    mx.random.seed(8)
    B = len(lengths)
    keys, values = (mx.random.normal((B, HKV, M * BT, Dq)) for _ in range(2))
    for a in (keys, values):
        a[1, :, : SHARED * BT] = a[0, :, : SHARED * BT]
    q = mx.random.normal((B, HQ, 1, Dq))
    k, v = mx.random.normal((B, HKV, 1, Dq)), mx.random.normal((B, HKV, 1, Dq))
    positions = mx.array(lengths, mx.int32)[:, None]
    scale = Dq**-0.5
    want, _, _ = CacheAttention(positions, scale)(None)(
        q, kv_roundtrip(k, bits), kv_roundtrip(v, bits), kv_roundtrip(keys, bits), kv_roundtrip(values, bits)
    )
    exact, _, _ = CacheAttention(positions, scale)(None)(q, k, v, keys, values)
    table = tables(random.Random(12), lengths, 1)
    all_positions = mx.broadcast_to(mx.arange(M * BT, dtype=mx.int32)[None], (B, M * BT))
    pools = []
    for a in (keys, values):
        empty = quantized_pool(N, HKV, BT, Dq, bits, 64, mx.float32)
        pools.append(write_quantized(empty, paged_index(table, all_positions, HKV, BT), a, bits, 64))
    attend = mx.compile(
        lambda table, positions, q, k, v, pk, pv: QuantizedPagedAttention(table, positions, scale, bits)(None)(
            q, k, v, pk, pv
        )
    )
    got, pool_keys, _ = attend(table, positions, q, k, v, *pools)
    assert pool_keys[0].dtype == mx.uint32 and pool_keys[0].shape == (N, HKV, BT, Dq * bits // 32)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4), mx.abs(got - want).max()
    error = float(mx.abs(got - exact).max())
    assert 0 < error < (0.05 if bits == 8 else 0.5), error
    view = gather_quantized(cast(Quantized, pool_keys), paged_index(table, positions, HKV, BT))
    for b, length in enumerate(lengths):
        stored = mx.dequantize(*(part[b, :, : length + 1] for part in view), group_size=64, bits=bits)
        expected = kv_roundtrip(mx.concatenate([keys[b, :, :length], k[b]], axis=1), bits)
        assert mx.allclose(stored, expected, atol=1e-6), b


def test_quantized_pool_refuses_a_head_dim_off_the_group_size():
    with pytest.raises(ValueError):
        quantized_pool(N, HKV, BT, 48, 8, 64, mx.float32)
    with pytest.raises(ValueError):
        quantized_pool(N, HKV, BT, 64, 3, 64, mx.float32)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_paged_step_equals_mlx_lms_quantized_kv_cache_attention(bits):
    """One decode step of a layer over a kv_bits pool gives what mlx-lm's ``QuantizedKVCache``
    and its ``scaled_dot_product_attention`` give for each row alone (the same history and new
    key and value, the same bits and group size), to float32 rounding."""
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import QuantizedKVCache

    Dq, lengths, scale = 64, LENGTHS, 64**-0.5
    mx.random.seed(3)
    B = len(lengths)
    keys, values = (mx.random.normal((B, HKV, M * BT, Dq)) * 3 for _ in range(2))
    for a in (keys, values):
        a[1, :, : SHARED * BT] = a[0, :, : SHARED * BT]
    q = mx.random.normal((B, HQ, 1, Dq))
    k, v = mx.random.normal((B, HKV, 1, Dq)), mx.random.normal((B, HKV, 1, Dq))
    table = tables(random.Random(5), lengths, 1)
    all_positions = mx.broadcast_to(mx.arange(M * BT, dtype=mx.int32)[None], (B, M * BT))
    valid = (all_positions < mx.array(lengths)[:, None])[:, None, :, None]
    index = paged_index(table, all_positions, HKV, BT)
    pools = [
        write_quantized(quantized_pool(N, HKV, BT, Dq, bits, 64, mx.float32), index, a, bits, 64)
        for a in (mx.where(valid, keys, 0.0), mx.where(valid, values, 0.0))
    ]
    positions = mx.array(lengths, mx.int32)[:, None]
    got, _, _ = QuantizedPagedAttention(table, positions, scale, bits)(None)(q + 0, k, v, *pools)
    for b, length in enumerate(lengths):
        cache = QuantizedKVCache(group_size=64, bits=bits)
        cache.update_and_fetch(keys[b : b + 1, :, :length], values[b : b + 1, :, :length])
        qk, qv = cache.update_and_fetch(k[b : b + 1], v[b : b + 1])
        want = scaled_dot_product_attention(q[b : b + 1] + 0, qk, qv, cache=cache, scale=scale, mask=None)
        assert mx.allclose(got[b : b + 1], want, atol=1e-5, rtol=1e-5), (b, mx.abs(got[b : b + 1] - want).max())
