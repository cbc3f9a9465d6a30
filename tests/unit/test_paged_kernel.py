"""The CUDA paged decode attention kernel (:mod:`models.paged_kernel`) against the portable path
it replaces on that back-end: the same attention over views gathered from the pool, with random
block tables (shuffled, shared and null blocks), rows at different positions across many blocks,
sliding windows, grouped query heads, and each float dtype; then a compiled model's paged decode
steps with and without it. These run only where MLX has its CUDA back-end (the lent GPU machine):
elsewhere the kernel never runs and the portable path is what :mod:`tests.unit.test_paged_kv`
tests. One test runs everywhere: off a CUDA GPU the kernel does not apply."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from models import llama, paged_kernel
from models.attention import cache_layout
from models.paged import PagedAttention, PagedKV, gather
from tests.support import WIDE, random_params

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernel runs on MLX's CUDA back-end only")

BT, N = 16, 700  # block tokens, pool blocks


@pytest.fixture
def kernel_on():
    """The kernel enabled (the default), restored whatever a test set."""
    paged_kernel.enable(True)
    yield
    paged_kernel.enable(True)


def random_tables(rng: random.Random, positions: list[int], columns: int) -> mx.array:
    """int32 [B, columns]: each row distinct shuffled blocks for positions 0..its position (rows 0
    and 1 share their first block), null-padded."""
    ids = rng.sample(range(1, N), N - 1)
    rows: list[list[int]] = []
    for b, p in enumerate(positions):
        need = p // BT + 1
        row = [ids.pop() for _ in range(need)]
        if b == 1 and rows and need > 1:
            row[0] = rows[0][0]
        rows.append(row + [0] * (columns - need))
    return mx.array(rows, mx.int32)


def merge_reference(o, ml):
    """The reduce kernel's arithmetic in MLX ops (see :func:`models.paged_kernel.reduce_partitions`):
    float32 [R, S, D] partition outputs and [R, S, 2] (largest score, softmax sum) -> [R, D]."""
    top, total = ml[..., 0:1], ml[..., 1:2]
    weight = total * mx.exp(top - top.max(axis=1, keepdims=True))  # an empty partition weighs 0
    return (o * weight).sum(axis=1) / weight.sum(axis=1)


def reference(q, keys, values, table, positions, scale, window):
    """The portable path's answer in float32: gathered views, cache_layout's mask, MLX's SDPA."""
    view_k, view_v = (gather(p.astype(mx.float32), table) for p in (keys, values))
    mask = cache_layout(positions[:, None], window, view_k.shape[2])[1]
    return mx.fast.scaled_dot_product_attention(q.astype(mx.float32), view_k, view_v, scale=scale, mask=mask)


def test_the_kernel_does_not_apply_off_a_cuda_gpu_or_when_disabled(kernel_on):
    q, pool = mx.zeros((1, 4, 1, 64)), mx.zeros((2, 2, BT, 64))
    assert paged_kernel.applies(q, pool) == (mx.cuda.is_available() and mx.default_device().type == mx.DeviceType.gpu)
    paged_kernel.enable(False)
    assert not paged_kernel.applies(q, pool)


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("view", [1024, 2048], ids=["one-pass", "split"])
def test_decode_attention_equals_the_gathered_views_attention(kernel_on, dtype, head_dim, window, view):
    positions = [0, 15, 16, 700, view - 1, 333]  # a first token, block edges, many tiles per warp
    hq, hkv, columns = 8, 2, view // BT
    assert (paged_kernel.partitions(view)[0] > 1) == (view > 1024)
    rng = random.Random(head_dim + (window or 0))
    table = random_tables(rng, positions, columns)
    mx.random.seed(head_dim)
    keys, values = (mx.random.normal((N, hkv, BT, head_dim)).astype(dtype) for _ in range(2))
    q = mx.random.normal((len(positions), hq, 1, head_dim)).astype(dtype)
    at, scale = mx.array(positions, mx.int32), head_dim**-0.5
    got = paged_kernel.decode_attention(q, keys, values, table, at, scale, window)
    want = reference(q, keys, values, table, at, scale, window)
    assert got.shape == q.shape and got.dtype == dtype
    tol = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 2e-2}[dtype]
    err = mx.abs(got.astype(mx.float32) - want).max().item()
    assert err < tol, err
    # a control: another table reads other blocks, and the kernel's answer moves with it
    other = random_tables(random.Random(99), positions, columns)
    moved = paged_kernel.decode_attention(q, keys, values, other, at, scale, window)
    assert mx.abs(moved.astype(mx.float32) - want).max().item() > 10 * tol


@cuda
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize(("view", "positions"), [(256, [5, 90, 200]), (8192, [5, 90, 5000])], ids=["one-pass", "split"])
def test_paged_attention_runs_the_kernel_under_compile_with_the_table_an_input(kernel_on, window, view, positions):
    """A traced step, in a single pass and split into partitions merged by the reduce kernel."""
    hq, hkv, D = 6, 2, 64
    columns = view // BT
    mx.random.seed(1)
    keys, values = (mx.random.normal((N, hkv, BT, D)) for _ in range(2))
    q = mx.random.normal((3, hq, 1, D))
    k, v = mx.random.normal((3, hkv, 1, D)), mx.random.normal((3, hkv, 1, D))
    at = mx.array(positions, mx.int32)[:, None]
    assert paged_kernel.applies(q, keys)
    traces = []

    def step(table, at, q, k, v, keys, values):
        return PagedAttention(table, at, D**-0.5)(window)(q, k, v, keys, values)

    def traced(*inputs):
        traces.append(1)  # Python runs only while tracing
        return step(*inputs)

    compiled = mx.compile(traced)
    for seed in (3, 4):
        table = random_tables(random.Random(seed), positions, columns)
        got, got_keys, _ = compiled(table, at, q, k, v, keys, values)
        paged_kernel.enable(False)
        want, want_keys, _ = step(table, at, q, k, v, keys, values)
        paged_kernel.enable(True)
        assert mx.allclose(got, want, atol=1e-5), (seed, mx.abs(got - want).max().item())
        assert mx.array_equal(got_keys, want_keys)
    assert len(traces) == 1  # one trace served both tables: the table is an input, not a constant


@cuda
def test_a_models_paged_decode_steps_give_the_portable_paths_greedy_tokens(kernel_on):
    """WIDE (heads of 64) through :func:`models.llama.decode_paged`, compiled, 24 steps of 3
    rows at different positions (rows 0 and 1 sharing a block): the kernel's greedy tokens are
    the gather path's, and its logits agree to 1e-4 of their scale (this random model's logits
    reach about 85; float32 sums in another order, carried through 24 steps' keys and values,
    moved them by up to 0.007 on one H200)."""
    params = random_params(WIDE, seed=5)
    D, hkv, layers = WIDE.dim_per_head, WIDE.num_key_value_heads, WIDE.num_hidden_layers
    starts, columns = [3, 17, 40], 8
    table = random_tables(random.Random(7), [s + 24 for s in starts], columns)
    mx.random.seed(8)
    filled = [mx.random.normal((N, hkv, BT, D)) * 0.5 for _ in range(2 * layers)]

    def run(on: bool) -> tuple[list[list[int]], mx.array]:
        paged_kernel.enable(on)

        def decode(tokens, positions, keys, values):
            logits, pool = llama.decode_paged(params, tokens, positions, table, PagedKV(keys, values), args=WIDE)
            return logits, pool.keys, pool.values

        step = mx.compile(decode)
        keys, values = list(filled[:layers]), list(filled[layers:])
        tokens, out, logits = mx.array([1, 2, 3], mx.int32), [], None
        for i in range(24):
            logits, keys, values = step(tokens, mx.array(starts, mx.int32) + i, keys, values)
            tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
            out.append(tokens.tolist())
        assert logits is not None
        return out, logits

    got, got_logits = run(True)
    want, want_logits = run(False)
    assert got == want
    scale = mx.abs(want_logits).max().item()
    assert mx.abs(got_logits - want_logits).max().item() <= 1e-4 * scale


def test_merging_partitions_gives_the_softmax_over_all_their_positions():
    """The kernel's partitions each attend over their own positions; merged by their largest
    score and softmax sum they give attention over every position at once, an empty partition
    (a row shorter than the view) weighing nothing: the reference the reduce kernel is checked
    against, itself checked here on any back-end."""
    rng = random.Random(7)
    rows, parts, per, D = 3, 5, 8, 4
    scores = [[[rng.gauss(0, 3) for _ in range(per)] for _ in range(parts)] for _ in range(rows)]
    values = mx.random.normal((rows, parts, per, D), key=mx.random.key(7))
    filled = [5, 1, 3]  # row r's positions lie in its first filled[r] partitions
    o, ml = [], []
    for r in range(rows):
        for s in range(parts):
            if s < filled[r]:
                sc = mx.array(scores[r][s])
                top = sc.max()
                e = mx.exp(sc - top)
                o.append((e[:, None] * values[r, s]).sum(axis=0) / e.sum())
                ml.append(mx.stack([top, e.sum()]))
            else:
                o.append(mx.zeros((D,)))
                ml.append(mx.array([-float("inf"), 0.0]))
    got = merge_reference(mx.stack(o).reshape(rows, parts, D), mx.stack(ml).reshape(rows, parts, 2))
    for r in range(rows):
        sc = mx.array([x for s in range(filled[r]) for x in scores[r][s]])
        want = mx.softmax(sc)[None] @ values[r, : filled[r]].reshape(-1, D)
        assert mx.allclose(got[r], want[0], atol=1e-5), (r, got[r], want)
    assert not mx.allclose(got[1], got[0], atol=1e-3)  # rows differ: the control


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
def test_the_reduce_kernel_merges_as_the_mlx_ops_do(dtype):
    """The split step's merge in one kernel equals :func:`merge_reference` (MLX ops), empty
    partitions (score -inf, sum 0) included, cast to the queries' dtype."""
    rows, parts, D = 12, 16, 128
    mx.random.seed(3)
    o = mx.random.normal((rows, parts, D))
    top = mx.random.normal((rows, parts, 1)) * 4
    total = mx.random.uniform(0.5, 30.0, (rows, parts, 1))
    empty = mx.arange(parts)[None, :, None] >= mx.array([16, 3, 1, 9, 16, 16, 2, 5, 16, 7, 11, 1])[:, None, None]
    ml = mx.concatenate([mx.where(empty, -float("inf"), top), mx.where(empty, 0.0, total)], axis=-1)
    o = mx.where(empty, 0.0, o)
    got = paged_kernel.reduce_partitions(o, ml, dtype)
    want = merge_reference(o, ml)
    assert got.dtype == dtype and got.shape == (rows, D)
    tol = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 2e-2}[dtype]
    assert mx.abs(got.astype(mx.float32) - want).max().item() < tol


def test_views_up_to_1024_are_one_pass_longer_ones_partitions_of_512_up_to_32_in_whole_tiles():
    assert paged_kernel.partitions(256) == (1, 256)
    assert paged_kernel.partitions(1000) == (1, 1024)
    assert paged_kernel.partitions(1024) == (1, 1024)
    assert paged_kernel.partitions(1040) == (3, 352)
    assert paged_kernel.partitions(1536) == (3, 512)
    assert paged_kernel.partitions(4096) == (8, 512)
    assert paged_kernel.partitions(4112) == (9, 480)
    assert paged_kernel.partitions(8192) == (16, 512)
    assert paged_kernel.partitions(20480) == (32, 640)
    parts, per = paged_kernel.partitions(131072)
    assert (parts, per) == (32, 4096) and parts * per >= 131072


@cuda
@pytest.mark.parametrize("window", [None, 3000])
@pytest.mark.parametrize(
    ("view", "positions"), [(8192, [7_000, 5, 511, 512, 4_100]), (20_480, [19_999, 5, 16_383, 639, 640])]
)
def test_a_long_row_beside_short_ones_spans_partitions_of_a_split_view(kernel_on, window, view, positions):
    """Views of 8,192 positions (16 partitions of 512) and 20,480 (32 of 640, not a multiple of
    512): one row near the end, rows at a partition's edges, short ones whose later partitions
    are empty."""
    assert paged_kernel.partitions(view)[0] > 1
    blocks, D, hq, hkv = sum(p // BT + 1 for p in positions) + 1, 64, 8, 2
    columns = view // BT
    rng = random.Random(11 + (window or 0))
    ids = rng.sample(range(1, blocks), blocks - 1)
    rows = []
    for p in positions:
        need = p // BT + 1
        rows.append([ids.pop() for _ in range(need)] + [0] * (columns - need))
    table = mx.array(rows, mx.int32)
    mx.random.seed(5)
    keys, values = (mx.random.normal((blocks, hkv, BT, D)).astype(mx.float16) for _ in range(2))
    q = mx.random.normal((len(positions), hq, 1, D)).astype(mx.float16)
    at, scale = mx.array(positions, mx.int32), D**-0.5
    got = paged_kernel.decode_attention(q, keys, values, table, at, scale, window)
    want = reference(q, keys, values, table, at, scale, window)
    err = mx.abs(got.astype(mx.float32) - want).max().item()
    assert err < 2e-3, err
