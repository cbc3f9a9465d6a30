"""Quantized KV (``kv_bits``) on the real default model, in process (``service.offline.LLM``):
20 prompts, 128 greedy tokens each, with the paged pool at 8 bits agree with the same pool at
full precision on at least 95% of the tokens (position by position), and the pool holds more
tokens in the same bytes. (4 bits: docs/BENCHMARKS.md.)"""

from __future__ import annotations

import pytest

from service.offline import LLM

TOPICS = [
    "the history of the printing press", "how bees find flowers", "why the sky is blue",
    "the rules of chess", "how a bicycle stays upright", "the water cycle", "what a compiler does",
    "how tides work", "the life of a star", "why bread rises", "how vaccines train the body",
    "the causes of the seasons", "how a refrigerator cools", "what makes a good map",
    "the migration of birds", "how paper is made", "why cats purr", "how rainbows form",
    "the invention of the telephone", "how coral reefs grow",
]  # fmt: skip
PROMPTS = [f"Write a short explanation of {topic}." for topic in TOPICS]
TOKENS = 128
SETTINGS = {  # every prompt at once in one batch bucket; a pool of 8,192 tokens (20 x ~145 needed)
    "kv_cache": "paged",
    "kv_pool_tokens": 8192,
    "batch_buckets": [1, 32],
    "prompt_buckets": [32],
    "capacity_buckets": [256],
    "prefill_chunk_tokens": 32,
    "prefix_cache_bytes": 0,
    "warmup_prompt_tokens": 16,
    "warmup_batch": 1,
    "warmup_rehearsal": False,
}


def generate(**settings) -> tuple[list[list[int]], int]:
    """Each prompt's greedy tokens (the chat template applied, EOS ignored) and the pool's bytes."""
    with LLM(**SETTINGS, **settings) as llm:
        tokenizer = llm.engine.model.tokenizer
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        outs = llm.generate(texts, max_tokens=TOKENS, ignore_eos=True)
        pool = llm.engine.executor.pool
        assert pool is not None
        return [o.token_ids for o in outs], pool.nbytes


@pytest.fixture(scope="module")
def full():
    return generate()


def test_8_bit_kv_agrees_with_full_precision_on_95_percent_of_tokens(full):
    reference, full_bytes = full
    got, quantized_bytes = generate(kv_bits=8)
    assert all(len(t) == TOKENS for t in reference + got)
    same = sum(a == b for r, g in zip(reference, got, strict=True) for a, b in zip(r, g, strict=True))
    assert same / (len(PROMPTS) * TOKENS) >= 0.95, same
    assert quantized_bytes < 0.6 * full_bytes  # 8 bits and a scale and bias per 64 values, against 32 bits
