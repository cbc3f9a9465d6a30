"""Quantized KV (``kv_bits``) for mlx-lm's own classes on the paged pool
(:func:`models.adapter.decode_paged` and ``verify_paged`` with ``bits``), on the CPU in float32.

The reference is mlx-lm's own generation with its ``QuantizedKVCache``, built as stepserve
builds its pool: the prompt prefilled at full precision (mlx-lm's ``KVCache``), then its keys
and values quantized (``KVCache.to_quantized``, the conversion mlx-lm's ``generate`` makes at
``quantized_kv_start``), then one decode step per token, each new token quantized as it is
written. Our rows sit in a pool of quantized noise through shuffled block tables (a read of a
position never written would show), prefilled by the adapter at full precision and written
into their blocks quantized (:func:`models.paged.write_quantized`, the ``mx.quantize`` that
``Executor.write_blocks`` applies at join), and decode together, compiled, fed mlx-lm's greedy
tokens (teacher forcing, so a near-tie cannot make the rows drift apart).

Tolerances: the two compute the same quantized attention over the same quantized values (they
matched to within 1e-6 here), so a logit may differ by float32 reordering, or by one rounding
step where a value of the two full-precision prefills lies on a quantization boundary. The bound,
1e-3 at 8 bits and 1e-2 at 4 bits, is over 10 times below how far quantization moves these
logits from full precision (at least 1.2e-2 at 8 bits and 1.9e-1 at 4 bits measured here; the
test checks it stays so), so an unquantized attention, or keys quantized twice, fail it.
"""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache as MlxLmKVCache

from models import adapter
from models.adapter import AdapterArgs
from models.errors import ModelLoadError
from models.kv_cache import KVCache
from models.paged import PagedKV, Quantized, paged_index, write_quantized
from tests.parity.build import WIDE_HEADS, build_tiny

BT, M, N = 4, 8, 40  # block tokens, table columns (capacity 32), pool blocks
PROMPTS = [[3, 1, 4], [9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]
STEPS = 12  # decode steps per row: rows cross 3 or 4 block boundaries, Gemma 3's window of 4 slides
TOLERANCE = {8: 1e-3, 4: 1e-2}  # see the module doc
AGREEMENT = {8: 0.95, 4: 0.85}  # greedy tokens equal to mlx-lm's, of every row's steps


def wide(name: str) -> tuple[Any, AdapterArgs]:
    """mlx-lm's tiny random ``name`` with heads of 64 (one quantization group; 4 query heads
    over 2 key-value heads, so mlx-lm's quantized attention groups queries), and its args."""
    module = build_tiny(name, **WIDE_HEADS)
    return module, AdapterArgs.from_module(module)


def mlx_lm_decode(module, prompt: list[int], bits: int | None, tokens: list[int] | None = None):
    """mlx-lm's own decode after ``prompt`` prefilled at full precision (its ``KVCache``), its
    caches then quantized to ``bits`` (``to_quantized``, groups of 64; None: kept at full
    precision): (the tokens fed, float32 logits [STEPS, V]). Feeds ``tokens`` where given, else
    its own greedy tokens (the first from the prefill's logits)."""
    caches = [MlxLmKVCache() for _ in module.layers]
    logits = module(mx.array([prompt], mx.int32), cache=caches)[0, -1]
    if bits:
        caches = [c.to_quantized(group_size=64, bits=bits) for c in caches]
    fed, out = [], []
    token = int(mx.argmax(logits).item())
    for j in range(STEPS):
        token = tokens[j] if tokens is not None else token
        fed.append(token)
        logits = module(mx.array([[token]], mx.int32), cache=caches)[0, -1].astype(mx.float32)
        out.append(logits)
        token = int(mx.argmax(logits).item())
    return fed, mx.stack(out)


def noise(shape: tuple[int, ...], bits: int, seed: int) -> Quantized:
    """A quantized pool [N, Hkv, bt, D] of normal noise (x3)."""
    mx.random.seed(seed)
    packed, scales, biases = mx.quantize(mx.random.normal(shape) * 3, group_size=64, bits=bits)
    return packed, scales, biases


def quantized_pool(args: AdapterArgs, prompts: list[list[int]], bits: int) -> tuple[PagedKV, mx.array]:
    """A pool of quantized noise with each prompt prefilled by the adapter at full precision and
    written into its blocks quantized, through a table of shuffled distinct blocks covering the
    prompt and :data:`STEPS` more positions (null-block padded). Returns (pool, table [B, M])."""
    params, H, D = args.module.parameters(), args.num_key_value_heads, args.dim_per_head
    layers = len(args.kv_layouts)
    keys = [noise((N, H, BT, D), bits, 2 * i) for i in range(layers)]
    values = [noise((N, H, BT, D), bits, 2 * i + 1) for i in range(layers)]
    ids = list(range(1, N))
    random.Random(3).shuffle(ids)
    rows = []
    for prompt in prompts:
        need = -(-(len(prompt) + STEPS) // BT)
        rows.append([ids.pop() for _ in range(need)] + [0] * (M - need))
    table = mx.array(rows, mx.int32)
    for b, prompt in enumerate(prompts):
        tokens, n = mx.array([prompt], mx.int32), mx.array([len(prompt)], mx.int32)
        kv: KVCache = adapter.prefill(params, tokens, n, args.allocate(1, len(prompt), mx.float32), args=args)[1]
        index = paged_index(table[b : b + 1], mx.arange(len(prompt), dtype=mx.int32)[None], H, BT)
        for layer in range(layers):
            keys[layer] = write_quantized(keys[layer], index, kv.keys[layer], bits, 64)
            values[layer] = write_quantized(values[layer], index, kv.values[layer], bits, 64)
    return PagedKV(keys, values), table


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", ["llama", "gemma3_text", "phi3", "olmo2"])
def test_a_quantized_pool_decodes_as_mlx_lms_quantized_cache(name, bits):
    module, args = wide(name)
    assert args.prefix_blocks and not args.capacity_pair and (args.windows is not None) == (name == "gemma3_text")
    references = [mlx_lm_decode(module, prompt, bits) for prompt in PROMPTS]
    pool, table = quantized_pool(args, PROMPTS, bits)
    assert pool.quantized
    params = args.module.parameters()
    step = mx.compile(lambda t, p, tb, pl: adapter.decode_paged(params, t, p, tb, pl, args=args, bits=bits))
    steps = []
    for j in range(STEPS):
        tokens = mx.array([fed[j] for fed, _ in references], mx.int32)
        logits, pool = step(tokens, mx.array([len(p) + j for p in PROMPTS], mx.int32), table, pool)
        steps.append(logits)
    got = mx.stack(steps, axis=1)  # [B, STEPS, V]
    want = mx.stack([logits for _, logits in references])
    full = mx.stack([mlx_lm_decode(module, p, None, fed)[1] for p, (fed, _) in zip(PROMPTS, references, strict=True)])
    off, moved = mx.abs(got - want).max().item(), mx.abs(full - want).max().item()
    assert off <= TOLERANCE[bits], f"{name} at {bits} bits: logits {off:.2e} from mlx-lm's quantized cache"
    assert moved > 10 * TOLERANCE[bits], f"quantization moved {name}'s logits by {moved:.2e} only: a weak test"
    agree = (mx.argmax(got, axis=-1) == mx.argmax(want, axis=-1)).astype(mx.float32).mean().item()
    assert agree >= AGREEMENT[bits], f"{name} at {bits} bits: greedy tokens agree on {agree:.0%} of steps"


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_a_quantized_pool_verifies_as_it_decodes(name):
    """A verify step of 4 tokens per row over the 8-bit pool gives the logits of decode steps one
    token at a time over the same pool (each token quantized as it is written, in both)."""
    _, args = wide(name)
    pool, table = quantized_pool(args, PROMPTS, 8)
    params = args.module.parameters()
    W = 4
    tokens = mx.array([[11 + j + 10 * b for j in range(W)] for b in range(len(PROMPTS))], mx.int32)
    positions = mx.array([len(p) for p in PROMPTS], mx.int32)
    verified, _ = adapter.verify_paged(params, tokens, positions, table, pool, args=args, bits=8)
    decoded = pool
    for j in range(W):
        logits, decoded = adapter.decode_paged(params, tokens[:, j], positions + j, table, decoded, args=args, bits=8)
        assert mx.allclose(verified[:, j], logits, atol=1e-4), (name, j)


def test_an_unquantized_call_over_a_quantized_pool_is_refused():
    _, args = wide("llama")
    pool, table = quantized_pool(args, PROMPTS[:1], 8)
    with pytest.raises(ValueError, match="kv_bits = None over a quantized pool"):
        adapter.decode_paged(args.module.parameters(), mx.array([1]), mx.array([3]), table, pool, args=args)


def test_gemma2_whose_attention_reads_the_keys_itself_is_found_by_the_probe():
    """mlx-lm's gemma2 computes its scores itself (logit soft-capping), so over quantized keys
    it would get a tuple: the probe's one eager step names it; llama attends through mlx-lm's
    ``scaled_dot_product_attention`` and passes; gpt_oss's attention sinks are refused by
    mlx-lm's quantized attention itself."""
    _, gemma2 = wide("gemma2")
    found = adapter.quantized_attention_error(gemma2, 8, 64, mx.float32)
    assert found is not None and found.startswith("gemma2's attention fails on quantized keys (TypeError"), found
    _, llama = wide("llama")
    assert adapter.quantized_attention_error(llama, 8, 64, mx.float32) is None
    _, gpt_oss = wide("gpt_oss")
    assert "attention sinks" in (adapter.quantized_attention_error(gpt_oss, 4, 64, mx.float32) or "")


def test_start_up_serves_kv_bits_for_a_class_that_attends_quantized_keys_and_refuses_one_that_cannot():
    """``check_memory`` (start-up's check of every model) sizes an 8-bit pool for mlx-lm's llama
    and refuses mlx-lm's gemma2 by name, with the reason and the fix."""
    from service.config import Settings
    from service.process.startup import check_memory
    from tests.unit.test_engine_adapter import tiny_model

    def settings(name: str) -> Settings:
        keys = dict(model_name=name, kv_cache="paged", kv_bits=8, prefix_cache_bytes=0, memory_budget_bytes=10**8)
        return Settings(batch_buckets=[1, 2], prompt_buckets=[16], capacity_buckets=[32, 64], **keys)

    llama = tiny_model("llama", **WIDE_HEADS)
    assert (check_memory(settings("llama"), {"llama": llama}).kv_pool_tokens or 0) > 0
    gemma2 = tiny_model("gemma2", **WIDE_HEADS)
    refused = r"model 'gemma2': kv_bits = 8 is not implemented for mlx-lm's class mlx_lm\.models\.gemma2\.Model: "
    why = r"gemma2's attention fails on quantized keys .*; remove kv_bits$"
    with pytest.raises(ModelLoadError, match=refused + why):
        check_memory(settings("gemma2"), {"gemma2": gemma2})
