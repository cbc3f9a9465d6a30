"""Real workloads against the real default model served by a real server (default settings):
a prompt of ~4,200 tokens is prefilled in chunks and continues as mlx-lm continues it; chats
sharing a system prompt reuse its prefix (OpenAI's ``cached_tokens``) and get the answers they
get without it; and after ``/readyz`` no request, of any length or concurrency, compiles."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.utils import dequantize_model

from models.default import default_model_path
from models.gguf.reader import read_gguf
from models.gguf.vocab import tokenizer_from_gguf

SECTION = (
    "Section {i}. The committee reviewed the quarterly figures for the northern depot, noting that "
    "deliveries rose while returns fell, and that the new scheduling rules cut idle time at the docks. "
)


def long_document(tokens: int, tokenizer) -> str:
    text, i = "", 0
    while len(tokenizer.encode(text)) < tokens:
        text += SECTION.format(i=i)
        i += 1
    return text


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's tokenizer, as the server builds it."""
    path = default_model_path()
    return tokenizer_from_gguf(read_gguf(path)[1], path)


def compiles(server) -> float:
    """Compiles the server timed (warm-up's included); a bucket left cold runs eagerly."""
    return server.metric("stepserve_compile_seconds_count")


def test_a_4200_token_prompt_continues_as_mlx_lm_continues_it(server, converted):
    """Past the 4,096 capacity bucket: nine 512-token chunks, decode at capacity 6,144."""
    reference, hf_tokenizer = mlx_lm.load(str(converted))
    reference.set_dtype(mx.float32)  # then expanded to dense float32, as stepserve serves on the CPU
    reference = dequantize_model(reference)
    prompt = long_document(4200, hf_tokenizer) + "\nIn one sentence, the committee found that"
    ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
    assert 4200 <= len(ids) <= 4500
    before = compiles(server)
    # mlx-lm generates here while the server serves the same prompt (separate processes, neither
    # reads the other's work): alone, each leaves a 2-core CPU partly idle (139 s one after the
    # other, 102 s together, measured).
    with ThreadPoolExecutor(1) as pool, server.client() as client:
        reply = pool.submit(client.post, "/infer", json={"prompt": prompt, "max_tokens": 16})
        expected = mlx_lm.generate(reference, hf_tokenizer, prompt=ids, max_tokens=16)
        served = reply.result()
    assert served.status_code == 200, served.text
    body = served.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["text"].strip() == expected.strip(), (body["text"], expected)  # mlx-lm drops the leading space
    assert compiles(server) == before  # no request compiles after ready


def test_chats_sharing_a_system_prompt_reuse_it(server, tokenizer):
    system = long_document(400, tokenizer) + "Answer briefly."
    questions = ["What rose?", "What fell?", "What did the new rules cut?", "Which depot was reviewed?"]

    def chat(question: str) -> dict:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        with server.client() as client:
            reply = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0})
        assert reply.status_code == 200, reply.text
        return reply.json()

    first = chat(questions[0])  # fills the cache
    again = chat(questions[0])
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 384
    replies: dict[str, dict] = {}
    threads = [threading.Thread(target=lambda q=q: replies.__setitem__(q, chat(q))) for q in questions[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for q in questions[1:]:
        assert replies[q]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 384, q
    assert server.metric("stepserve_prefix_cache_hit_tokens_total") >= 4 * 384


def test_no_request_compiles_after_ready(server, tokenizer):
    before = compiles(server)
    prompts = [long_document(n, tokenizer) for n in (20, 300, 700, 1800)]
    results: list[int] = []

    def ask(prompt: str, max_tokens: int) -> None:
        with server.client() as client:
            results.append(client.post("/infer", json={"prompt": prompt, "max_tokens": max_tokens}).status_code)

    threads = [threading.Thread(target=ask, args=(prompts[i % 4], 4 + i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 8
    assert compiles(server) == before
