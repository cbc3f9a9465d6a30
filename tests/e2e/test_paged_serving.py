"""The paged KV pool on the real default model through a real server (``--kv-cache paged``, its
prefix cache in the pool's blocks): a burst of concurrent requests that outgrows a small pool is
served with preemptions (the preempted requests resuming from their own cached blocks), every
answer the one the static cache's server gives; a prompt sharing a long prefix with an earlier one
reuses its blocks (``cached_tokens``) and answers as the static cache's prefix cache does; a
copying answer speculates (prompt lookup, verify steps over the pool) and is the static cache's
answer without speculation; and ``/readyz`` and ``/metrics`` say what the pool holds."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import ServerProcess

POOL_TOKENS = 256
PROMPTS = [f"Write a short story about a {thing} who learns to {skill}." for thing, skill in [
    ("lighthouse keeper", "paint"),
    ("river otter", "count"),
    ("retired pilot", "bake bread"),
    ("small robot", "whistle"),
    ("city pigeon", "read maps"),
]]  # fmt: skip


@pytest.fixture(scope="module")
def paged():
    """The default model with a 256-token pool (one capacity bucket of 256, so one sequence fits
    alone) in blocks of 16: five 64-token answers to ~15-token prompts need ~400. Prefix caching
    is on (the default ``prefix_cache_bytes``): it lives in the pool's blocks. Prompt lookup
    speculates in every batch bucket (no calibration: this CPU's verdict would vary), its verify
    steps over the pool's blocks too."""
    proc = ServerProcess.start(
        [
            "--kv-cache", "paged", "--kv-pool-tokens", str(POOL_TOKENS), "--kv-block-tokens", "16",
            "--capacity-buckets", "[256]", "--prompt-buckets", "[32, 64]", "--warmup-batch", "8",
            "--warmup-prompt-tokens", "64", "--speculative", "lookup", "--speculative-max-batch", "8",
        ]
    )  # fmt: skip
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def complete(proc: ServerProcess, prompt: str) -> str:
    with proc.client() as http:
        body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 64
    return reply.json()["choices"][0]["text"]


def test_a_burst_past_the_pool_is_preempted_and_answers_as_the_static_cache(paged, server):
    with paged.client() as http:
        kv = http.get("/readyz").json()["models"]["SmolLM2-135M-Instruct"]["kv"]
    assert kv["cache"] == "paged" and kv["tokens"] >= POOL_TOKENS and kv["block_tokens"] == 16
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: complete(paged, p), PROMPTS))
        expected = list(pool.map(lambda p: complete(server, p), PROMPTS))  # the static cache
    assert got == expected
    assert paged.metric("stepserve_preemptions_total", model="SmolLM2-135M-Instruct") > 0
    assert paged.metric("stepserve_kv_pool_blocks", model="SmolLM2-135M-Instruct", state="used") == 0
    total = paged.metric("stepserve_kv_pool_blocks", model="SmolLM2-135M-Instruct", state="total")
    assert total * 16 == kv["tokens"]


SHARED = (
    "You are a careful assistant for a lighthouse museum. Answer in one plain sentence, name the "
    "exhibit the visitor should see first, and never invent opening hours. The museum has three "
    "rooms: the lamp room with a first-order Fresnel lens, the keeper's kitchen with a cast-iron "
    "stove, and the signal room with foghorns and flags. Visitor question: "
)  # ~80 tokens: five full blocks of 16


def test_a_shared_prefix_reuses_the_pools_blocks_and_answers_as_the_static_prefix_cache(paged, server):
    def ask(proc: ServerProcess, question: str) -> dict:
        with proc.client() as http:
            body = {"prompt": SHARED + question, "max_tokens": 24, "temperature": 0}
            reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()

    hits = paged.metric("stepserve_prefix_cache_hit_tokens_total", model="SmolLM2-135M-Instruct")
    questions = ["where is the lens?", "what is in the kitchen?"]
    got = [ask(paged, q) for q in questions]
    expected = [ask(server, q) for q in questions]
    assert [g["choices"][0]["text"] for g in got] == [e["choices"][0]["text"] for e in expected]
    cached = got[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 64 and cached % 16 == 0, got[1]["usage"]  # the shared prefix's full blocks
    after = paged.metric("stepserve_prefix_cache_hit_tokens_total", model="SmolLM2-135M-Instruct")
    assert after - hits >= cached


PASSAGE = (
    "The river near the old mill was quiet in winter, and the keeper of the lantern wrote a letter about it. "
    "In the spring the market filled with stone carvers, and the harbour smelled of salt and bread."
)


def test_a_copying_answer_speculates_over_the_pool_and_answers_as_the_static_cache(paged, server):
    def chat(proc: ServerProcess) -> str:
        messages = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"}]
        with proc.client() as http:
            reply = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 48, "temperature": 0})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]

    name = "SmolLM2-135M-Instruct"
    before = paged.metric("stepserve_speculative_accepted_tokens_total", model=name)
    assert chat(paged) == chat(server)  # the static cache, no speculation
    assert paged.metric("stepserve_speculative_accepted_tokens_total", model=name) > before
    assert paged.metric("stepserve_kv_pool_blocks", model=name, state="used") == 0
