"""mlx-lm's model classes served by a real `stepserve serve` (real uvicorn, real HTTP) through
the cache adapter: a tiny random Qwen3-Next (recurrent and attention layers, no hand-written
module: ``model_impl = auto`` takes mlx-lm's class), a tiny Nemotron-H (mamba layers that ignore
padding: prefilled in exact rows) and the default model SmolLM2, as its GGUF and converted to a
directory, served with ``model_impl = mlx_lm``, answer /v1/chat/completions with mlx-lm's own
greedy tokens (``mlx_lm.generate.generate_step`` on the converted directory); the Gemma 3 270M
GGUF served with ``model_impl = mlx_lm`` (mlx-lm's gemma3_text) completes prompts with mlx-lm's
greedy tokens on the directory ``stepserve convert`` writes; a refused ``model_type`` stops
start-up naming it."""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load_model as lm_load_model

from models.adapter.support import REFUSED
from models.default import default_model_path
from models.gguf.convert import convert_gguf
from models.hf import tokenizer_from_dir
from service.api.tools import render_messages
from tests.parity.tiny_configs import TINY_CONFIGS
from tests.support import STEPSERVE, ServerProcess, gemma_gguf, write_mlx_lm_dir

#: Small buckets and a small warm-up: the compiled steps are what is served, quickly built (no
#: rehearsal: what is tested is the tokens, not how soon the first requests run).
SMALL = [
    "--batch-buckets", "[1,2,4]", "--prompt-buckets", "[32,64]", "--capacity-buckets", "[128,256]",
    "--warmup-prompt-tokens", "64", "--warmup-batch", "2", "--prefill-chunk-tokens", "32",
    "--warmup-rehearsal", "false",
]  # fmt: skip
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three colours of the rainbow, please, and say why the sky is blue."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2 + 2?"}],
]
MAX_TOKENS = 16


def mlx_lm_texts(directory: Path, prompts: list[list[dict]] | list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
    """The text of mlx-lm's greedy tokens for each chat (or raw prompt) of ``prompts`` on
    ``directory`` (mlx-lm's load, its layers expanded and float32 as the CPU serves them; each
    prompt rendered and tokenized as the server does), up to the first stop token."""
    model, _ = lm_load_model(directory)
    model.set_dtype(mx.float32)  # its scales and biases first: expanded in float32, as the server does
    model = dequantize_model(model)
    tokenizer = tokenizer_from_dir(directory, json.loads((directory / "config.json").read_text()))
    texts = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt if isinstance(prompt, str) else render_messages(tokenizer, prompt, None))
        tokens = []
        for token, _ in generate_step(mx.array(ids, mx.int32), model, max_tokens=max_tokens):
            if int(token) in tokenizer.stop_token_ids:
                break
            tokens.append(int(token))
        texts.append(tokenizer.decode(tokens))
    return texts


def chats(server: ServerProcess, max_tokens: int = MAX_TOKENS) -> list[str]:
    """Every chat of CHATS sent at once (greedy); each reply's text."""

    def ask(messages: list[dict]) -> str:
        with server.client() as client:
            reply = client.post(
                "/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens, "temperature": 0}
            )
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(len(CHATS)) as pool:
        return list(pool.map(ask, CHATS))


def served(directory: Path, *flags: str) -> list[str]:
    """CHATS answered by a real server of ``directory`` started with ``flags``."""
    server = ServerProcess.start(["--model", str(directory), *SMALL, *flags])
    try:
        server.wait_ready()
        return chats(server)
    finally:
        server.stop()


def test_a_tiny_qwen3_next_directory_serves_mlx_lms_greedy_tokens(tmp_path, converted):
    """No hand-written module: ``auto`` serves it through mlx-lm's class. The vocabulary is
    SmolLM2's (its tokenizer and chat template are copied in)."""
    directory = tmp_path / "qwen3-next"
    write_mlx_lm_dir(directory, {**TINY_CONFIGS["qwen3_next"], "vocab_size": 49152}, tokenizer_from=converted)
    server = ServerProcess.start(["--model", str(directory), *SMALL, "--prefix-cache-bytes", "1000000"])
    try:
        server.wait_ready()
        got = chats(server)
        with server.client() as client:
            n2 = client.post(
                "/v1/chat/completions",
                json={"messages": CHATS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "n": 2, "logprobs": True},
            ).json()
            structured = client.post(
                "/v1/chat/completions",
                json={"messages": CHATS[0], "max_tokens": 24, "response_format": {"type": "json_object"}},
            )
    finally:
        server.stop()
    assert structured.status_code == 200, structured.text
    assert structured.json()["choices"][0]["message"]["content"].lstrip().startswith("{")
    assert "prefix cache off (its recurrent state cannot be cut at a block boundary)" in server.log()
    assert "prefill and chunk steps run eagerly (its gated delta layers loop" in server.log()  # the CPU's ops loop
    expected = mlx_lm_texts(directory, CHATS)
    assert got == expected
    assert [c["message"]["content"] for c in n2["choices"]] == [expected[0]] * 2
    assert all(c["logprobs"]["content"] for c in n2["choices"])


def test_a_tiny_nemotron_h_whose_recurrent_layers_ignore_padding_serves_mlx_lms_greedy_tokens(tmp_path, converted):
    """Its mamba layers ignore padding: the chats' prompts (none a prompt bucket long) are
    prefilled in full chunks, concurrently, never padded: chunks of 32, their remainders in
    chunks of the powers of two below it and a last token alone (the steps that ran, from
    /metrics: no whole padded prefill)."""
    directory = tmp_path / "nemotron-h"
    write_mlx_lm_dir(directory, {**TINY_CONFIGS["nemotron_h"], "vocab_size": 49152}, tokenizer_from=converted)
    server = ServerProcess.start(["--model", str(directory), *SMALL])
    try:
        server.wait_ready()
        got = chats(server)
        with server.client() as client:
            metrics = client.get("/metrics").text
    finally:
        server.stop()
    assert got == mlx_lm_texts(directory, CHATS)
    steps = [
        dict(re.findall(r'(\w+)="([^"]*)"', labels)) for labels in re.findall(r"step_seconds_count\{(.*)\}", metrics)
    ]
    prompt_steps = {(s["phase"], s["bucket"].split("x")[1].split("c")[0]) for s in steps if s["phase"] != "decode"}
    assert {phase for phase, _ in prompt_steps} == {"chunk"}, prompt_steps
    sizes = {int(T) for _, T in prompt_steps}
    assert 32 in sizes and sizes <= {32, 16, 8, 4, 2, 1} and sizes & {16, 8, 4, 2}, prompt_steps


def test_smollm2_served_through_mlx_lm_gives_mlx_lms_tokens(converted):
    """The native server against mlx-lm on the same directory: tests/e2e/test_parity.py. The
    two servers and mlx-lm here run at once (three processes, none reading another's work: 27 ->
    18 s on 2 cores)."""
    with ThreadPoolExecutor(2) as pool:
        directory = pool.submit(served, converted, "--model-impl", "mlx_lm")
        gguf = pool.submit(served, default_model_path(), "--model-impl", "mlx_lm")
        expected = mlx_lm_texts(converted, CHATS)
        through_mlx_lm, gguf_through_mlx_lm = directory.result(), gguf.result()
    assert through_mlx_lm == expected
    assert gguf_through_mlx_lm == expected
    assert "Paris" in through_mlx_lm[0]


GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
GEMMA_FLAGS = ["--model-name", "gemma", "--capacity-buckets", "[256]", "--prompt-buckets", "[32]"]
GEMMA_FLAGS += ["--batch-buckets", "[4]", "--warmup-batch", "4", "--warmup-rehearsal", "false"]


def test_gemma3_gguf_served_through_mlx_lm_completes_with_mlx_lms_tokens(tmp_path):
    """The base model has no chat template: /v1/completions, the prompts in one request
    (batched rows), 24 tokens each or up to <eos>."""
    server = ServerProcess.start(["--model", str(gemma_gguf()), "--model-impl", "mlx_lm", *GEMMA_FLAGS])
    try:
        directory = convert_gguf(gemma_gguf(), tmp_path / "gemma", mx.float32)  # while the server warms up
        expected = mlx_lm_texts(directory, GEMMA_PROMPTS, 24)
        server.wait_ready()
        with server.client() as client:
            reply = client.post(
                "/v1/completions",
                json={"model": "gemma", "prompt": GEMMA_PROMPTS, "max_tokens": 24, "temperature": 0},
            )
    finally:
        server.stop()
    assert reply.status_code == 200, reply.text
    assert "served by mlx-lm's class mlx_lm.models.gemma3_text.Model" in server.log()
    got = [choice["text"] for choice in sorted(reply.json()["choices"], key=lambda c: c["index"])]
    assert got == expected and all(expected)


@pytest.mark.parametrize("model_type", ["dbrx", "olmo"])
def test_a_refused_model_type_stops_start_up_naming_it(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    result = subprocess.run(
        [STEPSERVE, "serve", "--model", str(tmp_path), "--port", "0"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert f"model_type '{model_type}'" in result.stderr and REFUSED[model_type] in result.stderr
    assert "stepserve models" in result.stderr
