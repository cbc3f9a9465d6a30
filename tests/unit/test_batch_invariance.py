"""Greedy decoding of the real model does not depend on what else is in the batch: the same
prompts alone and inside a batch of 8 mixed lengths give the same tokens. Logit differences
(from matmul blocking that depends on the batch size) are reported and bounded."""

import mlx.core as mx
import pytest

from models.default import default_model_path
from models.loader import load_model
from service.engine.buckets import BucketTable
from service.engine.core import Engine
from tests.support import ON_GPU, engine_at

PROMPTS = [
    "Hi",
    "The capital of France is",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize foods"
    " from carbon dioxide and water. It",
    "Q: What is the boiling point of water at sea level? A:",
    "The three primary colours are",
]
STEPS = 6


@pytest.fixture(scope="module")
def engine() -> Engine:
    model = load_model(default_model_path(), "smol", mx.float32, "dequantized")
    return engine_at(model, BucketTable(batch=(1, 8), prompt=(32, 64), capacity=(128,)))


def greedy_run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[mx.array]]:
    """Prefill the prompts together, then decode STEPS greedy tokens for all of them."""
    logits, prompt_kv = engine.prefiller.prefill(prompts)
    n, C = len(prompts), engine.buckets.capacity[0]
    kv = prompt_kv.resized(C)
    history = [logits[:n]]
    tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    positions = mx.array([len(p) for p in prompts] + [0] * (kv.batch - n), mx.int32)
    out = [tokens[:n].tolist()]
    decode = engine.executor.step_fn("decode", kv.batch, C)
    for _ in range(STEPS):
        logits, kv = decode(engine.model.params, tokens, positions, kv)
        history.append(logits[:n])
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        positions = positions + 1
        out.append(tokens[:n].tolist())
    return [list(col) for col in zip(*out, strict=True)], history


def test_greedy_tokens_alone_equal_tokens_in_a_batch_of_8(engine, capsys):
    ids = [engine.model.tokenizer.encode(p) for p in PROMPTS]
    assert len({engine.buckets.prompt_for(len(i)) for i in ids}) == 2  # mixed lengths, padded to 64
    batched_tokens, batched_logits = greedy_run(engine, ids)
    worst = 0.0
    for i, prompt in enumerate(ids):
        alone_tokens, alone_logits = greedy_run(engine, [prompt])
        assert batched_tokens[i] == alone_tokens[0], f"prompt {i}: tokens differ alone vs in a batch"
        for a, b in zip(alone_logits, batched_logits, strict=True):
            worst = max(worst, mx.abs(a[0] - b[i]).max().item())
    with capsys.disabled():
        print(f"\nmax |logit alone - logit in batch of 8| over {STEPS + 1} steps: {worst:.2e}")
    assert worst < (0.25 if ON_GPU else 1e-2)  # GPU: TF32-like float32 matmuls (see conftest)
