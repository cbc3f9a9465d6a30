"""The second real model: Gemma 3 270M (a Q4_K_M GGUF) served by a real `stepserve serve` over
real HTTP. Its greedy tokens on a prompt set, requested concurrently (so batched), equal
mlx-lm's on the directory `stepserve convert` writes, with each token's logprob within 1e-3;
the OpenAI completions route gives the same text; the chat routes answer 400, the base model
having no chat template."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from tests.support import STEPSERVE, ServerProcess, gemma_gguf

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
]
MAX_TOKENS = 10
FLAGS = ["--model-name", "gemma", "--capacity-buckets", "[256]", "--prompt-buckets", "[32]"]
FLAGS += ["--batch-buckets", "[4]", "--warmup-batch", "4", "--warmup-rehearsal", "false"]  # one batch bucket to warm


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(the server, mlx-lm's tokenizer, mlx-lm's greedy (token, logprob) pairs per prompt on the
    converted weights). The server warms up while `stepserve convert` and mlx-lm run."""
    path = gemma_gguf()
    server = ServerProcess.start(["--model", str(path), *FLAGS])
    try:
        out = tmp_path_factory.mktemp("gemma") / "mlx"
        converted = subprocess.run(
            [STEPSERVE, "convert", str(path), str(out), "--dtype", "float32"], capture_output=True, text=True
        )
        assert converted.returncode == 0, converted.stderr
        model, tokenizer = mlx_lm.load(str(out))
        model.set_dtype(mx.float32)
        expected = {prompt: mlx_lm_tokens(model, tokenizer, prompt) for prompt in PROMPTS}
        server.wait_ready()
        yield server, tokenizer, expected
    finally:
        server.stop()


def mlx_lm_tokens(model, tokenizer, prompt: str) -> list[tuple[int, float]]:
    """mlx-lm's greedy (token, logprob) pairs for ``prompt`` (its tokenizer adds BOS, as ours)."""
    ids = tokenizer.encode(prompt)
    steps = stream_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS, sampler=make_sampler(0.0))
    return [(r.token, r.logprobs[r.token].item()) for r in steps]


def test_greedy_tokens_equal_mlx_lms_on_the_converted_weights(gemma):
    server, tokenizer, mlx_lm_greedy = gemma

    def infer(prompt: str) -> dict:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 0, "ignore_eos": True}
        with server.client() as client:
            return client.post("/infer", json=body).json()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: rows batched with each other
        served = list(pool.map(infer, PROMPTS))
    for prompt, answer in zip(PROMPTS, served, strict=True):
        expected = mlx_lm_greedy[prompt]
        assert [t["token_id"] for t in answer["logprobs"]] == [t for t, _ in expected], prompt
        worst = max(abs(t["logprob"] - lp) for t, (_, lp) in zip(answer["logprobs"], expected, strict=True))
        assert worst < 1e-3, f"{prompt!r}: max |logprob diff| {worst:.2e}"
        assert answer["text"] == tokenizer.decode([t for t, _ in expected])


def test_openai_completions_give_the_same_text(gemma):
    server, tokenizer, mlx_lm_greedy = gemma
    with server.client() as client:
        reply = client.post(
            "/v1/completions",
            json={"model": "gemma", "prompt": PROMPTS[:2], "max_tokens": MAX_TOKENS, "temperature": 0},
        )
    assert reply.status_code == 200, reply.text
    for prompt, choice in zip(PROMPTS[:2], reply.json()["choices"], strict=True):
        tokens = [t for t, _ in mlx_lm_greedy[prompt]]
        expected = tokenizer.decode(tokens[: tokens.index(1)] if 1 in tokens else tokens)  # stops at <eos>
        assert choice["text"] == expected


def test_chat_routes_answer_400_without_a_chat_template(gemma):
    server, _, _ = gemma
    messages = [{"role": "user", "content": "Hi"}]
    with server.client() as client:
        chat = client.post("/v1/chat/completions", json={"model": "gemma", "messages": messages})
        infer = client.post("/infer", json={"messages": messages})
    for reply in (chat, infer):
        assert reply.status_code == 400
        assert "no chat template" in reply.json()["error"]["message"]
