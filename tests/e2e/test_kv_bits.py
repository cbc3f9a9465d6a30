"""Quantized KV (``kv_bits``) on the real default model, on the server's paged decode step: with
the full-precision run's greedy tokens fed to an 8-bit pool (teacher forcing, one fixed batch,
so no scheduling or drift enters), at least 95% of positions pick the same token, in a pool of
under 30% of the bytes (float32); and a server (``service.offline.LLM``) with ``kv_bits = 8``
serves greedy requests to their length from a quantized pool. Free-running agreement and 4 bits:
``stepserve bench kv-bits`` (docs/BENCHMARKS.md, "Paged KV")."""

from __future__ import annotations

import mlx.core as mx
import pytest

from service.bench.kv_bits import paged_greedy, prompts
from service.offline import LLM

TOKENS = 64


@pytest.fixture(scope="module")
def model():
    from models.loader import load_model
    from service.process.startup import model_path, weights_mode

    return load_model(model_path(None), "default", mx.float32, weights_mode("auto"), impl="native")


def test_8_bit_kv_picks_the_full_precision_token_at_95_percent_of_positions_teacher_forced(model):
    tok = model.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in prompts(20)]
    reference, full_bytes, _ = paged_greedy(model, ids, TOKENS, None, None, 16)
    forced, quantized_bytes, _ = paged_greedy(model, ids, TOKENS, 8, reference, 16)
    agreement = float((forced == reference).mean())
    assert agreement >= 0.95, agreement
    assert quantized_bytes < 0.3 * full_bytes  # 8 bits and a float32 scale and bias per 64 values


def test_a_server_with_8_bit_kv_serves_greedy_requests_from_a_quantized_pool():
    settings = {"kv_cache": "paged", "kv_bits": 8, "kv_pool_tokens": 2048, "prefix_cache_bytes": 0}
    with LLM(**settings, warmup_prompt_tokens=16, warmup_batch=1, warmup_rehearsal=False) as llm:
        outs = llm.generate(prompts(4), max_tokens=32, ignore_eos=True)
        pool = llm.engine.executor.pool
        assert pool is not None and pool.quantized and pool.keys[0][0].dtype == mx.uint32
    assert [len(o.token_ids) for o in outs] == [32] * 4
