"""End to end: the real default model behind a real `stepserve serve` process over HTTP."""

import subprocess
import threading
import time

import pytest

from models.default import default_model_path
from models.gguf.reader import read_gguf
from models.gguf.vocab import tokenizer_from_gguf
from models.tokenizer import ChatTokenizer
from tests.support import STEPSERVE, ServerProcess

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32}


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return tokenizer_from_gguf(read_gguf(default_model_path())[1])


def prompt_of(tok: ChatTokenizer, n: int) -> str:
    """A natural-text prompt that encodes to exactly ``n`` tokens."""
    base = "The history of the city begins with a small harbour where fishermen traded salt, wool and stories. " * 40
    ids = tok.encode(base)[:n]
    text = tok.decode(ids)
    while len(tok.encode(text)) != n:  # a cut inside a merge can re-tokenize differently
        ids = ids[:-1] + tok.encode(" a")
        text = tok.decode(ids)
    return text


def test_readyz_is_503_until_warmup_is_done(server):
    assert server.readyz_codes[0] == 503 and server.readyz_codes[-1] == 200
    with server.client() as client:
        body = client.get("/readyz").json()
    ready = body["models"]["SmolLM2-135M-Instruct"]
    assert ready["warmed"] > 0 and ready["compiled"] == ready["warmed"]  # compile on: every bucket compiled
    assert ready["speculative"] is None  # speculation is off by default
    warm = ready["warmup"]  # what is warm: the whole CPU extent (the fixture's budget fits it on any host)
    assert (warm["prompt_tokens"], warm["batch"], warm["rehearse"], warm["reduced"]) == (512, 4, True, False)
    assert warm["buckets"] == ready["warmed"] and warm["gflops"] > 0 and warm["blas"] in ("openblas", "reference")
    assert "within warmup_budget_s 3600" in warm["reason"]


def test_a_host_too_slow_for_the_warmup_budget_is_ready_at_once_and_answers_eagerly():
    """No extent fits the budget (as on a slow BLAS): nothing compiles before ready, /readyz and
    the log say so, and a chat still answers, its buckets run eagerly, never compiled under it."""
    proc = ServerProcess.start(["--warmup-budget-s", "0"])
    try:
        proc.wait_ready()
        with proc.client() as client:
            warm = client.get("/readyz").json()["models"]["SmolLM2-135M-Instruct"]["warmup"]
            reply = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0})  # greedy
        assert (warm["prompt_tokens"], warm["buckets"], warm["rehearse"], warm["reduced"]) == (0, 0, False, True)
        assert "over warmup_budget_s 0" in warm["reason"]
        assert reply.status_code == 200 and "Paris" in reply.json()["choices"][0]["message"]["content"]
        log = proc.log()
        assert "warm-up reduced for this host to nothing" in log
        assert "was not warmed up: it runs eagerly" in log
        assert proc.metric("stepserve_compile_seconds_sum") == 0  # nothing compiled, before ready or after
    finally:
        proc.stop()


def test_warmup_sends_every_route_a_request_before_ready_and_counts_none(server):
    """The first clients find FastAPI's route handling, the chat template, the SSE writers and
    a first grammar already built (the HTTP rehearsal), and the metrics count only them."""
    with server.client() as client:
        rehearsed = client.get("/readyz").json()["models"]["SmolLM2-135M-Instruct"]["rehearsed"]
    http = [line for line in rehearsed if line.startswith("HTTP ")]
    for route in (
        "/infer",
        "/infer streamed",
        "/v1/completions",
        "/v1/chat/completions streamed",
        "/v1/responses streamed",
    ):
        assert f"HTTP {route}" in http
    assert any("JSON object" in line for line in http) and any("tool call" in line for line in http)
    assert any(line.startswith("HTTP a burst of 4 streamed completions") for line in http)  # the warmed concurrency
    assert not [line for line in http if "answered" in line or "failed" in line]  # each answered 200
    for name in (
        "stepserve_requests_total",
        "stepserve_generation_tokens_total",
        "stepserve_prompt_tokens_total",
        "stepserve_grammar_masks_total",
    ):
        assert server.metric(name, server.ready_metrics) == 0, name


def test_capital_of_france(server):
    with server.client() as client:
        reply = client.post("/infer", json=CHAT)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert "Paris" in body["text"]
    assert body["finish_reason"] == "stop" and body["model"] == "SmolLM2-135M-Instruct"
    assert body["usage"]["prompt_tokens"] > 20 and 0 < body["usage"]["completion_tokens"] <= 32
    timings = body["timings"]
    assert 0 <= timings["queue_s"] <= timings["ttft_s"] <= timings["total_s"]


# Lengths at and just past prompt-bucket edges (32, 64, 128, 256); 250 + 24 crosses the
# 256-position capacity bucket during decode, and 300 starts beyond it.
PARITY_LENGTHS = [7, 32, 33, 64, 65, 129, 250, 300]


def test_greedy_output_identical_with_compile_on_and_off(server, eager_server, tok):
    for n in PARITY_LENGTHS:
        request = {"prompt": prompt_of(tok, n), "max_tokens": 24, "temperature": 0}
        with server.client() as on, eager_server.client() as off:
            compiled, eager = on.post("/infer", json=request).json(), off.post("/infer", json=request).json()
        assert compiled["usage"] == eager["usage"], f"prompt of {n} tokens"
        assert compiled["usage"]["prompt_tokens"] == n
        assert compiled["text"] == eager["text"], f"prompt of {n} tokens: compiled and eager outputs differ"


def test_repeating_a_request_hits_the_compile_cache(server):
    with server.client() as client:
        client.post("/infer", json=CHAT)
        misses, hits = (
            server.metric("stepserve_compile_cache_misses_total"),
            server.metric("stepserve_compile_cache_hits_total"),
        )
        assert client.post("/infer", json=CHAT).status_code == 200
    assert server.metric("stepserve_compile_cache_misses_total") == misses
    assert server.metric("stepserve_compile_cache_hits_total") > hits


def test_same_seed_same_output(server):
    request = {
        "prompt": "Once upon a time",
        "max_tokens": 20,
        "temperature": 0.9,
        "top_p": 0.95,
        "top_k": 40,
        "seed": 1234,
    }
    with server.client() as client:
        first, second = client.post("/infer", json=request).json(), client.post("/infer", json=request).json()
        other = client.post("/infer", json={**request, "seed": 99}).json()
    assert first["text"] == second["text"]
    assert first["text"] != other["text"]


def test_stop_string_and_max_tokens(server):
    with server.client() as client:
        stopped = client.post("/infer", json={**CHAT, "stop": ["Paris"]}).json()
        short = client.post("/infer", json={"prompt": "Count: one, two, three,", "max_tokens": 3}).json()
    assert stopped["finish_reason"] == "stop" and "Paris" not in stopped["text"]
    assert short["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 3


BAD_REQUESTS = [
    ({"prompt": "hi", "max_tokens": 0}, 422, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, 422, "temperature"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 422, "messages.0.role"),
    ({"max_tokens": 5}, 422, "body"),
    ({"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "word " * 8300}, 400, "prompt"),  # over the largest capacity bucket (8192)
]


@pytest.mark.parametrize("request_body,status,param", BAD_REQUESTS)
def test_bad_input_gets_its_status_and_the_server_keeps_serving(server, request_body, status, param):
    with server.client() as client:
        reply = client.post("/infer", json=request_body)
        assert reply.status_code == status, reply.text
        assert reply.json()["error"]["param"] == param
        assert client.post("/infer", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200


def test_oversized_and_malformed_bodies(server):
    with server.client() as client:
        big = client.post(
            "/infer", content=b'{"prompt": "' + b"a" * (2 << 20) + b'"}', headers={"content-type": "application/json"}
        )
        assert big.status_code == 413 and "exceeds" in big.json()["error"]["message"]
        broken = client.post("/infer", content=b"{not json", headers={"content-type": "application/json"})
        assert broken.status_code == 422 and broken.json()["error"]["param"] == "body"
        assert client.post("/infer", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200


def test_metrics_move_as_requests_are_served(server):
    names = [
        "stepserve_prompt_tokens_total",
        "stepserve_generation_tokens_total",
        "stepserve_time_to_first_token_seconds_count",
        "stepserve_request_duration_seconds_count",
        "stepserve_inter_token_latency_seconds_count",
    ]
    before = {n: server.metric(n) for n in names}
    ok_before = server.metric("stepserve_requests_total", status="200")
    with server.client() as client:
        body = client.post("/infer", json={"prompt": "The sky is", "max_tokens": 5}).json()
    after = {n: server.metric(n) for n in names}
    assert (
        after["stepserve_prompt_tokens_total"] - before["stepserve_prompt_tokens_total"]
        == body["usage"]["prompt_tokens"]
    )
    assert (
        after["stepserve_generation_tokens_total"] - before["stepserve_generation_tokens_total"]
        == body["usage"]["completion_tokens"]
    )
    assert (
        after["stepserve_time_to_first_token_seconds_count"]
        == before["stepserve_time_to_first_token_seconds_count"] + 1
    )
    assert after["stepserve_inter_token_latency_seconds_count"] > before["stepserve_inter_token_latency_seconds_count"]
    assert server.metric("stepserve_requests_total", status="200") == ok_before + 1
    assert server.metric("stepserve_mlx_active_memory_bytes") > 100e6  # the weights at least
    assert server.metric("stepserve_build_info", device="cpu") == 1


def test_health_and_metrics_answer_during_a_generation(server):
    with server.client() as client:
        worker = threading.Thread(
            target=client.post, args=("/infer",), kwargs={"json": {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 120}}
        )
        worker.start()
        try:
            deadline = time.monotonic() + 60
            while server.metric("stepserve_requests_running") < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.metric("stepserve_requests_running") == 1, "the generation never showed as running"
            assert client.get("/healthz").status_code == 200
            assert client.get("/metrics").status_code == 200
            assert client.get("/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
        finally:
            worker.join()
    assert server.metric("stepserve_requests_running") == 0


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_bad_model_file_fails_start_up_naming_the_file(tmp_path, damage):
    path = tmp_path / "model.gguf"
    if damage == "truncated":
        path.write_bytes(default_model_path().read_bytes()[:200_000])
    result = subprocess.run(
        [STEPSERVE, "serve", "--model", str(path), "--port", "0"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert str(path) in result.stderr


def test_openapi_schema_and_docs(server):
    with server.client() as client:
        schema = client.get("/openapi.json").json()
        assert {"/infer", "/v1/completions", "/v1/chat/completions", "/v1/models", "/readyz", "/metrics"} <= set(
            schema["paths"]
        )
        assert client.get("/docs").status_code == 200
