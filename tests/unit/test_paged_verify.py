"""Speculative decoding's verify step over the paged KV pool (``verify_paged``), on the CPU in
float32: rows at different positions whose W tokens cross block boundaries, through shuffled
block tables, score every position as the static cache's ``verify`` does (and as prefilling the
text alone does, for each family with a paged decode: Gemma 3's sliding layers included), and
after a verify step whose later proposals were rejected, the row's blocks hold the accepted
tokens' keys and values where the next decode step reads them."""

from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import pytest

from models import llama
from models.architectures import architecture
from models.kv_cache import KVCache
from models.paged import PagedKV, gather, write
from tests.support import ATOL, TINY, noise_pool, paged_families, prefilled, random_params

BT, M, N = 4, 8, 40  # block tokens, table columns (capacity 32), pool blocks
PROMPTS = [[3, 1, 4], [9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]  # positions 3, 7, 13
TOKENS = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]  # each row's newest token, then 3 proposals
W = 4  # each row's newest token and 3 proposals: 3..6, 7..10 and 13..16 each cross a block boundary


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple]:
    """:func:`tests.support.paged_families` (llama at seed 5)."""
    return paged_families(tmp_path_factory.mktemp("paged-verify"), llama_seed=5)


def pool_of(args, prompts_kv: list[KVCache], seed: int) -> tuple[PagedKV, mx.array]:
    """A pool of garbage (normal noise: a read of a position never written shows) with each row's
    prompt keys and values written through a table of shuffled, distinct blocks covering its
    prompt and W more positions (null-block padded). Returns (pool, table int32 [B, M])."""
    ids = list(range(1, N))
    random.Random(seed).shuffle(ids)
    pool, layers = noise_pool(args, N, BT, seed), args.num_hidden_layers
    rows = []
    for kv in prompts_kv:
        need = -(-(kv.capacity + W) // BT)
        rows.append([ids.pop() for _ in range(need)] + [0] * (M - need))
    table = mx.array(rows, mx.int32)
    for b, kv in enumerate(prompts_kv):
        at = mx.arange(kv.capacity, dtype=mx.int32)[None]
        for layer in range(layers):
            pool.keys[layer] = write(pool.keys[layer], table[b : b + 1], at, kv.keys[layer])
            pool.values[layer] = write(pool.values[layer], table[b : b + 1], at, kv.values[layer])
    return pool, table


def static_of(args, prompts_kv: list[KVCache]) -> KVCache:
    """The same rows in a static cache [B, Hkv, M * bt, D] of garbage past each prompt."""
    shape = (len(prompts_kv), args.num_key_value_heads, M * BT, args.dim_per_head)
    kv = KVCache(
        [mx.random.normal(shape) * 3 for _ in range(args.num_hidden_layers)],
        [mx.random.normal(shape) * 3 for _ in range(args.num_hidden_layers)],
    )
    for b, row in enumerate(prompts_kv):
        for layer in range(args.num_hidden_layers):
            kv.keys[layer][b, :, : row.capacity] = row.keys[layer][0]
            kv.values[layer][b, :, : row.capacity] = row.values[layer][0]
    return kv


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3_text", "qwen3_moe"])
def test_paged_verify_scores_every_position_as_prefilling_it_alone(families, family):
    args, params = families[family]
    arch = architecture(args.model_type)
    rows = [prefilled(arch, args, params, p)[1] for p in PROMPTS]
    pool, table = pool_of(args, rows, seed=1)
    tokens = mx.array(TOKENS, mx.int32)
    positions = mx.array([len(p) for p in PROMPTS], mx.int32)
    fn = mx.compile(lambda t, p, tb, pl: arch.verify_paged(params, t, p, tb, pl, args=args))
    logits, pool = fn(tokens, positions, table, pool)
    assert logits.shape == (len(PROMPTS), W, args.vocab_size)
    for b, prompt in enumerate(PROMPTS):
        for j in range(W):
            expected, _ = prefilled(arch, args, params, prompt + TOKENS[b][: j + 1])
            assert mx.allclose(logits[b, j], expected, atol=ATOL), (family, b, j)
    if hasattr(arch, "verify"):  # the static cache's verify step gives the same logits
        static, _ = arch.verify(params, tokens, positions, static_of(args, rows), args=args)
        assert mx.allclose(logits, static, atol=ATOL), family


def test_after_a_rejection_the_blocks_hold_the_accepted_tokens_where_later_steps_read(families):
    """Row 1 verifies 3 proposals of which the first is accepted (the model's own greedy token)
    and the second rejected: its blocks then hold the prompt and the two accepted tokens' keys
    and values at their positions (as prefilling them alone writes them), and the next decode
    step at the new position, over the rejected tokens' leftovers, gives the text's own logits."""
    args, params = families["llama"]
    prompt = PROMPTS[1]
    rows = [prefilled(llama, args, params, p)[1] for p in PROMPTS]
    pool, table = pool_of(args, rows, seed=2)
    logits, _ = prefilled(llama, args, params, prompt + [21])
    good = int(mx.argmax(logits).item())  # type: ignore[arg-type]  # a 0-d array's item is an int
    bad = (good + 1) % args.vocab_size
    tokens = mx.array([[11, 12, 13, 14], [21, good, bad, 5], [31, 32, 33, 34]], mx.int32)
    positions = mx.array([len(p) for p in PROMPTS], mx.int32)
    out, pool = llama.verify_paged(params, tokens, positions, table, pool, args=args)
    y = [int(mx.argmax(out[1, j]).item()) for j in range(W)]  # type: ignore[arg-type]
    assert y[0] == good and y[1] != bad  # one accepted, the next rejected: y[1] is the bonus token
    accepted = prompt + [21, good]
    _, alone = prefilled(llama, args, params, accepted)
    for layer in range(args.num_hidden_layers):
        view = gather(pool.keys[layer], table)[1, :, : len(accepted)]
        assert mx.allclose(view, alone.keys[layer][0], atol=ATOL), layer
        view = gather(pool.values[layer], table)[1, :, : len(accepted)]
        assert mx.allclose(view, alone.values[layer][0], atol=ATOL), layer
    step = mx.array([0, y[1], 0], mx.int32)
    at = mx.array([0, len(accepted), 0], mx.int32)
    decoded, _ = llama.decode_paged(params, step, at, table * mx.array([[0], [1], [0]]), pool, args=args)
    expected, _ = prefilled(llama, args, params, accepted + [y[1]])
    assert mx.allclose(decoded[1], expected, atol=ATOL)


def test_a_quantized_pool_verifies_as_it_decodes():
    """With ``kv_bits`` 8, a verify step's logits equal those of decode steps one token at a time
    over the same quantized pool (each token quantized as it is written, in both)."""
    args = dataclasses.replace(TINY, num_attention_heads=1, num_key_value_heads=1)  # D = 64: one quantization group
    params = random_params(args, seed=6)
    bits, layers, H = 8, args.num_hidden_layers, args.num_key_value_heads
    pool = PagedKV.allocate(layers, N, H, BT, args.dim_per_head, mx.float32, bits)
    table = mx.array([[5, 9, 2, 0, 0, 0, 0, 0]], mx.int32)
    ids = [3, 1, 4, 1, 5, 9]
    decode = pool
    for p, t in enumerate(ids):  # the prompt, one decode step per token, into both pools
        _, decode = llama.decode_paged(params, mx.array([t]), mx.array([p]), table, decode, args=args, bits=bits)
    verify = decode
    steps = []
    tokens = [2, 6, 5, 3]
    for j, t in enumerate(tokens):
        logits, decode = llama.decode_paged(
            params, mx.array([t]), mx.array([len(ids) + j]), table, decode, args=args, bits=bits
        )
        steps.append(logits[0])
    out, _ = llama.verify_paged(params, mx.array([tokens]), mx.array([len(ids)]), table, verify, args=args, bits=bits)
    for j in range(len(tokens)):
        assert mx.allclose(out[0, j], steps[j], atol=1e-3), j


def mlx_lm_logits(module, ids: list[int]) -> mx.array:
    """mlx-lm's own logits [V] after ``ids`` prefilled alone through its own caches."""
    from mlx_lm.models.cache import make_prompt_cache

    return module(mx.array([ids], mx.int32), cache=make_prompt_cache(module))[0, -1].astype(mx.float32)


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "phi3"])
def test_the_adapters_paged_verify_scores_every_position_as_mlx_lm_prefilling_it_alone(name):
    """mlx-lm's own class over the pool (:func:`models.adapter.verify_paged`), compiled: rows at
    positions 3, 7 and 13 whose 4 tokens cross block boundaries, through shuffled tables over a
    pool of noise, score every position as mlx-lm prefilling the text alone does (Gemma 3's
    window of 4 is slid past: its mask on the linear view is the window), and the pool then holds
    each row's keys and values as the adapter's prefill of the whole text writes them."""
    from models import adapter
    from models.adapter import AdapterArgs
    from tests.parity.build import build_tiny

    module = build_tiny(name)
    args = AdapterArgs.from_module(module)
    assert args.prefix_blocks and not args.capacity_pair and (args.windows is not None) == (name == "gemma3_text")
    params = module.parameters()

    def prefilled(ids: list[int]) -> KVCache:
        tokens, n = mx.array([ids], mx.int32), mx.array([len(ids)], mx.int32)
        return adapter.prefill(params, tokens, n, args.allocate(1, len(ids), mx.float32), args=args)[1]

    shaped = dataclasses.replace(
        TINY,
        num_hidden_layers=len(args.kv_layouts),
        num_key_value_heads=args.num_key_value_heads,
        head_dim=args.dim_per_head,
    )
    pool, table = pool_of(shaped, [prefilled(p) for p in PROMPTS], seed=3)
    tokens = mx.array(TOKENS, mx.int32)
    positions = mx.array([len(p) for p in PROMPTS], mx.int32)
    fn = mx.compile(lambda t, p, tb, pl: adapter.verify_paged(params, t, p, tb, pl, args=args))
    logits, pool = fn(tokens, positions, table, pool)
    assert logits.shape == (len(PROMPTS), W, args.vocab_size) and logits.dtype == mx.float32
    for b, prompt in enumerate(PROMPTS):
        for j in range(W):
            expected = mlx_lm_logits(module, prompt + TOKENS[b][: j + 1])
            assert mx.allclose(logits[b, j], expected, atol=ATOL), (name, b, j)
        whole = prefilled(prompt + TOKENS[b])
        n = len(prompt) + W
        for layer in range(len(args.kv_layouts)):
            assert mx.allclose(gather(pool.keys[layer], table)[b, :, :n], whole.keys[layer][0], atol=ATOL)
            assert mx.allclose(gather(pool.values[layer], table)[b, :, :n], whole.values[layer][0], atol=ATOL)
