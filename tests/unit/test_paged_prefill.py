"""The prefill step straight into the paged KV pool (``prefill_paged``), on the CPU in float32:
rows of different offsets and lengths, each with its earlier positions already in shuffled
blocks of a pool of noise, prefill a padded chunk compiled and get the logits that prefilling
their whole text on a linear cache gives (for each family with a paged decode: Gemma 3's sliding
layers included); the chunk's real keys and values land in exactly the positions of the blocks
the table names, and nothing else in the pool changes but the null block (padding included)."""

from __future__ import annotations

import random
from functools import partial

import mlx.core as mx
import numpy as np
import pytest

from models import llama
from models.architectures import architecture
from models.kv_cache import KVCache
from models.paged import NULL_BLOCK, PagedKV, write
from tests.support import ATOL, WIDE, noise_pool, paged_families, prefilled, random_params

BT, M, N = 4, 6, 40  # block tokens, table columns (a view of 24 positions), pool blocks
T = 8  # the chunk bucket
TEXTS = [  # (a row's whole text, its offset: positions already in its blocks)
    ([3, 1, 4, 1, 5], 0),  # a whole prompt: padding 5..7 falls in its own block 1
    ([9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], 4),  # a chunk 4..10 across two block boundaries; padding 11
    ([2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5], 17),  # 17..18; padding 19..24 past its table
]
EXTRA = [1, 1, 0]  # blocks each row holds past its text (reserved for decode: padding must miss them)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple]:
    """:func:`tests.support.paged_families` (llama at seed 7)."""
    return paged_families(tmp_path_factory.mktemp("paged-prefill"), llama_seed=7)


def tables(seed: int, rows: int) -> tuple[list[list[int]], mx.array]:
    """Each text's shuffled distinct blocks (its text and EXTRA more) and the table int32
    [rows, M] (null-block padded; rows past the texts all null)."""
    ids = list(range(1, N))
    random.Random(seed).shuffle(ids)
    sizes = [-(-len(text) // BT) + extra for (text, _), extra in zip(TEXTS, EXTRA, strict=True)]
    blocks = [[ids.pop() for _ in range(n)] for n in sizes]
    table = [b + [NULL_BLOCK] * (M - len(b)) for b in blocks] + [[NULL_BLOCK] * M] * (rows - len(TEXTS))
    return blocks, mx.array(table, mx.int32)


def run(args, params, arch, pool: PagedKV, table: mx.array, rows: int) -> tuple[mx.array, PagedKV]:
    """Each text's chunk (offset..end) compiled at (rows, T, M * BT); rows past the texts are
    padding (offset 0, length 1, null table)."""
    chunks = [text[offset:] + [0] * (T - len(text) + offset) for text, offset in TEXTS] + [[0] * T] * (
        rows - len(TEXTS)
    )
    offsets = [offset for _, offset in TEXTS] + [0] * (rows - len(TEXTS))
    lengths = [len(text) - offset for text, offset in TEXTS] + [1] * (rows - len(TEXTS))
    fn = mx.compile(partial(arch.prefill_paged, args=args))
    return fn(
        params,
        mx.array(chunks, mx.int32),
        mx.array(offsets, mx.int32),
        mx.array(lengths, mx.int32),
        table,
        pool,
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3_text", "qwen3_moe"])
def test_a_paged_prefill_gives_the_linear_prefills_logits_and_writes_only_its_rows_positions(families, family):
    args, params = families[family]
    arch = architecture(args.model_type)
    rows = 4  # a batch bucket: row 3 is padding
    blocks, table = tables(seed=11, rows=rows)
    alone = [prefilled(arch, args, params, text) for text, _ in TEXTS]
    pool = noise_pool(args, N, BT, seed=12)
    for b, (_, offset) in enumerate(TEXTS):  # the earlier chunks' positions, as they left them
        if offset:
            at = mx.arange(offset, dtype=mx.int32)[None]
            for layer in range(args.num_hidden_layers):
                kv = alone[b][1]
                pool.keys[layer] = write(pool.keys[layer], table[b : b + 1], at, kv.keys[layer][:, :, :offset])
                pool.values[layer] = write(pool.values[layer], table[b : b + 1], at, kv.values[layer][:, :, :offset])
    before = [(np.array(k), np.array(v)) for k, v in zip(pool.keys, pool.values, strict=True)]

    logits, after = run(args, params, arch, pool, table, rows)

    assert logits.shape == (rows, args.vocab_size) and logits.dtype == mx.float32
    for b in range(len(TEXTS)):
        assert mx.allclose(logits[b], alone[b][0], atol=ATOL), (family, b)
    for layer in range(args.num_hidden_layers):
        for got, old, new in (
            (np.array(after.keys[layer]), before[layer][0], [a[1].keys[layer] for a in alone]),
            (np.array(after.values[layer]), before[layer][1], [a[1].values[layer] for a in alone]),
        ):
            expected = old.copy()
            for b, (text, offset) in enumerate(TEXTS):  # the chunk's real positions, and only those
                for p in range(offset, len(text)):
                    expected[blocks[b][p // BT], :, p % BT] = np.array(new[b][0, :, p])
            changed = np.flatnonzero(np.any(got != old, axis=(1, 2, 3)))
            assert NULL_BLOCK in changed, "padding is written into the null block"
            np.testing.assert_allclose(got[1:], expected[1:], atol=ATOL)


def test_padding_never_lands_in_a_block_another_row_or_the_prefix_cache_holds(families):
    """Two rows share their first block (a prefix hit: published, read only) and chunk after it;
    the padded rows' tables name that shared block and a row's reserved block: only the null
    block and the chunks' own positions change."""
    args, params = families["llama"]
    arch = architecture(args.model_type)
    shared, mine, theirs, reserved = 5, 9, 13, 17
    text = [4, 4, 2, 1, 7, 3]
    _, alone = prefilled(arch, args, params, text)
    pool = noise_pool(args, N, BT, seed=21)
    at = mx.arange(BT, dtype=mx.int32)[None]
    hit = mx.array([[shared]], mx.int32)
    for layer in range(args.num_hidden_layers):
        pool.keys[layer] = write(pool.keys[layer], hit, at, alone.keys[layer][:, :, :BT])
        pool.values[layer] = write(pool.values[layer], hit, at, alone.values[layer][:, :, :BT])
    before = [np.array(k) for k in pool.keys]
    table = mx.array([[shared, mine, reserved], [shared, theirs, 0], [0, 0, 0], [0, 0, 0]], mx.int32)
    chunk = text[BT:] + [0] * (T - len(text) + BT)
    fn = mx.compile(partial(arch.prefill_paged, args=args))
    logits, after = fn(
        params,
        mx.array([chunk, chunk, [0] * T, [0] * T], mx.int32),
        mx.array([BT, BT, 0, 0], mx.int32),
        mx.array([len(text) - BT] * 2 + [1, 1], mx.int32),
        table,
        pool,
    )
    expected, _ = prefilled(arch, args, params, text)
    assert mx.allclose(logits[0], expected, atol=ATOL) and mx.allclose(logits[1], expected, atol=ATOL)
    for layer in range(args.num_hidden_layers):
        got = np.array(after.keys[layer])
        changed = set(np.flatnonzero(np.any(got != before[layer], axis=(1, 2, 3))).tolist())
        assert changed == {NULL_BLOCK, mine, theirs}, changed
        assert np.array_equal(got[mine, :, len(text) - BT :], before[layer][mine, :, len(text) - BT :])


@pytest.mark.parametrize("bits", [8, 4])
def test_a_kv_bits_chunk_in_blocks_equals_decoding_its_tokens_one_at_a_time(bits):
    """A ``kv_bits`` pool's chunk prefilled in its blocks (a whole prompt, then a second chunk
    at an offset, batched with a padding row) gives the logits that decode steps feeding the
    same tokens one at a time give, and leaves the same quantized keys: each query attends over
    the keys quantized as written, as a decode step's does. This is what lets a preempted
    request resume where it stopped. A chunk attending over its own keys at full precision (the
    staging path) misses by the quantization's error, far above the bound."""
    wide = WIDE  # heads of 64: one quantization group
    params, D = random_params(wide, seed=5), wide.dim_per_head
    text, split, blocks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 6, [7, 2, 9, 4]
    table = mx.array([blocks + [NULL_BLOCK] * (M - len(blocks)), [NULL_BLOCK] * M], mx.int32)

    def empty() -> PagedKV:
        return PagedKV.allocate(wide.num_hidden_layers, N, 1, BT, D, mx.float32, bits)

    decode = mx.compile(partial(llama.decode_paged, args=wide, bits=bits))
    pool, stepped = empty(), []
    for p, token in enumerate(text):
        logits, pool = decode(params, mx.array([token, 0], mx.int32), mx.array([p, 0], mx.int32), table, pool)
        stepped.append(logits[0])
    chunk = mx.compile(partial(llama.prefill_paged, args=wide, bits=bits))
    chunked, logits = empty(), []
    for start, end in ((0, split), (split, len(text))):
        tokens = [text[start:end] + [0] * (T - end + start), [0] * T]
        out, chunked = chunk(
            params, mx.array(tokens, mx.int32), mx.array([start, 0], mx.int32),
            mx.array([end - start, 1], mx.int32), table, chunked,
        )  # fmt: skip
        logits.append(out[0])
    for got, want in ((logits[0], stepped[split - 1]), (logits[1], stepped[-1])):
        assert mx.abs(got - want).max().item() < 1e-4
    rows = mx.array(blocks)
    for layer in range(wide.num_hidden_layers):
        for a, b in zip(pool.keys[layer], chunked.keys[layer], strict=True):
            assert mx.array_equal(a[rows], b[rows]) or mx.abs(a[rows].astype(mx.float32) - b[rows]).max() < 1e-4


def test_a_pipeline_stage_stages_a_kv_bits_prompt_as_one_process_attends_its_quantized_blocks():
    """A pipeline group prefills on staging caches: with ``kv_bits`` its stages attend over the
    keys and values quantized and dequantized (:func:`models.attention.kv_roundtrip`), so a
    stage holding every layer gives the logits one process gets prefilling into its quantized
    blocks, to float32 rounding; staged at full precision they differ by far more."""
    from models import pipeline

    wide = WIDE
    params, D, layers = random_params(wide, seed=5), wide.dim_per_head, wide.num_hidden_layers
    text, blocks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 2, 9]
    tokens, lengths = mx.array([text + [0] * (T * 2 - len(text))], mx.int32), mx.array([len(text)], mx.int32)
    table = mx.array([blocks + [NULL_BLOCK] * (M - len(blocks))], mx.int32)
    pool = PagedKV.allocate(layers, N, 1, BT, D, mx.float32, 8)
    in_blocks, _ = llama.prefill_paged(params, tokens, mx.array([0]), lengths, table, pool, args=wide, bits=8)
    stage = pipeline.Stage(rank=0, size=1, start=0, stop=layers)

    def staged(bits: int | None) -> mx.array:
        cache = KVCache.allocate(layers, 1, 1, T * 2, D, mx.float32)
        return pipeline.prefill(params, tokens, lengths, cache, args=wide, stage=stage, bits=bits)[0]

    assert mx.abs(staged(8) - in_blocks).max().item() < 1e-4
    assert mx.abs(staged(None) - in_blocks).max().item() > 1e-2
