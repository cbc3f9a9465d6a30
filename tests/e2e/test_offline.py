"""The offline entry point on the default model: ``LLM().generate`` runs prompts submitted
together through the server's own engine (built by the same builder) and gives each prompt the
greedy tokens of the model run on that prompt alone, step by step, outside the engine."""

from __future__ import annotations

import mlx.core as mx
import pytest

from models.architectures import architecture
from models.kv_cache import KVCache
from service.offline import LLM

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
MAX_TOKENS = 12
SMALL = {  # a fast start: a small bucket table and warm-up (cold buckets run eagerly)
    "batch_buckets": [1, 4],
    "prompt_buckets": [32],
    "capacity_buckets": [64],
    "prefill_chunk_tokens": 32,
    "warmup_prompt_tokens": 16,
    "warmup_batch": 1,
    "warmup_rehearsal": False,
}


def alone(llm: LLM, ids: list[int], steps: int) -> list[int]:
    """Greedy tokens of ``ids``: each step prefills the whole text so far, at its exact length."""
    model = llm.engine.model
    a, out = model.args, []
    prefill = architecture(a.model_type).prefill  # the model's own step, uncompiled, at the exact length
    for _ in range(steps):
        text = ids + out
        kv = KVCache.allocate(model.layers, 1, a.num_key_value_heads, len(text), a.dim_per_head, model.dtype, None)
        tokens, lengths = mx.array([text], mx.int32), mx.array([len(text)], mx.int32)
        logits, _ = prefill(model.params, tokens, lengths, kv, args=a)
        out.append(int(mx.argmax(logits[0]).item()))
        if out[-1] in model.tokenizer.stop_token_ids:
            break
    return out


@pytest.fixture(scope="module")
def llm():
    with LLM(**SMALL) as llm:
        yield llm


def test_prompts_generated_together_get_their_own_greedy_tokens(llm):
    outputs = llm.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [o.prompt for o in outputs] == PROMPTS
    tokenizer = llm.engine.model.tokenizer
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        assert out.token_ids == alone(llm, ids, MAX_TOKENS), prompt
        assert out.prompt_tokens == len(ids)
        assert out.finish_reason == ("stop" if out.token_ids[-1] in tokenizer.stop_token_ids else "length")
        assert out.text == tokenizer.decode([t for t in out.token_ids if t not in tokenizer.stop_token_ids])
    assert "Paris" in outputs[0].text


def test_a_stop_string_ends_the_text_and_a_prompt_that_cannot_fit_is_refused(llm):
    (full,) = llm.generate("The capital of France is", max_tokens=MAX_TOKENS)
    word = full.text.split()[1]  # the second word of the greedy answer
    (cut,) = llm.generate("The capital of France is", max_tokens=MAX_TOKENS, stop=(word,))
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(word)]
    with pytest.raises(ValueError, match="largest KV capacity bucket"):
        llm.generate("word " * 70, max_tokens=4)
