"""Continuous batching, streaming, the OpenAI routes, admission control and SIGTERM,
against real `stepserve serve` processes and the real model."""

import json
import signal
import subprocess
import threading
import time

import httpx
from openai import OpenAI

from tests.support import STEPSERVE, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # the model keeps counting: no early end-of-sequence
# Small servers: one slot and one queue place with a 10 s limit; two slots and 15 s of grace.
# The limits are far above what a short request needs on any CPU, and far below what a
# 2000-token one needs: what is tested is the lifecycle, not the speed of the matmuls (so no warm-up
# rehearsal either: its dummy requests only make the first real ones quicker).
QUEUE_LIMITS = {
    "STEPSERVE_BATCH_BUCKETS": "[1]",
    "STEPSERVE_MAX_WAITING": "1",
    "STEPSERVE_REQUEST_TIMEOUT_S": "10",
    "STEPSERVE_WARMUP_PROMPT_TOKENS": "32",
    "STEPSERVE_WARMUP_REHEARSAL": "false",
}
DRAIN = {
    "STEPSERVE_BATCH_BUCKETS": "[1, 2]",
    "STEPSERVE_SHUTDOWN_GRACE_S": "15",
    "STEPSERVE_WARMUP_PROMPT_TOKENS": "32",
    "STEPSERVE_WARMUP_BATCH": "2",
    "STEPSERVE_WARMUP_REHEARSAL": "false",
}


def sse_events(response: httpx.Response) -> list[dict]:
    return [
        json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
    ]


def wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_16_concurrent_clients_get_the_answers_they_would_get_alone(server):
    prompts = [f"Question {i}: name a colour." + " Think about it." * (i % 5) for i in range(16)]
    with server.client() as client:
        alone = [client.post("/infer", json={"prompt": p, "max_tokens": 12}).json()["text"] for p in prompts]
    results: dict[int, dict] = {}

    def ask(i):
        with server.client() as c:
            results[i] = c.post("/infer", json={"prompt": prompts[i], "max_tokens": 12}).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i]["text"] for i in range(16)] == alone
    assert all(
        r["finish_reason"] in ("stop", "length") and r["usage"]["completion_tokens"] > 0 for r in results.values()
    )
    assert server.metric("stepserve_batch_size_sum", phase="decode") > server.metric(
        "stepserve_batch_size_count", phase="decode"
    )


def test_streamed_text_equals_the_whole_text_for_the_same_seed(server):
    request = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.8, "seed": 7}
    with server.client() as client:
        whole = client.post("/infer", json=request).json()
        with client.stream("POST", "/infer", json={**request, "stream": True}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = sse_events(response)
    assert len(events) > 2
    assert "".join(e["text"] for e in events) == whole["text"]
    assert events[-1]["finish_reason"] == whole["finish_reason"] and events[-1]["usage"] == whole["usage"]


def test_a_disconnect_frees_the_slot(server):
    cancelled = server.metric("stepserve_cancellations_total", reason="client_disconnected")
    with server.client() as client:
        with client.stream("POST", "/infer", json={"prompt": COUNTING, "max_tokens": 2000, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert server.metric("stepserve_requests_running") == 1
    wait_for(lambda: server.metric("stepserve_requests_running") == 0, 10, "the slot to be freed")
    assert server.metric("stepserve_cancellations_total", reason="client_disconnected") == cancelled + 1
    with server.client() as client:
        assert client.post("/infer", json={"prompt": "Hello", "max_tokens": 3}).status_code == 200


def test_openai_client_completions_and_chat(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    text = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
    streamed = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    assert text.usage.completion_tokens == 8 and text.choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert "Paris" in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.total_tokens == chat.usage.total_tokens


def start_server(env: dict) -> ServerProcess:
    proc = ServerProcess.start([], env=env)
    try:
        proc.wait_ready()
    except Exception:
        proc.stop()
        raise
    return proc


def test_full_queue_429_and_time_limits():
    """One slot: the running request keeps counting past the 10 s limit, so it times out
    after its first tokens (200, "timeout"); the queued one times out waiting for the slot (504,
    or "timeout" after a first token when the freed slot let it start just before its limit); a
    third finds the queue full (429)."""
    server = start_server(QUEUE_LIMITS)
    try:
        long_prompt = COUNTING  # 2000 tokens to go: it is still generating at the limit
        replies: dict[str, httpx.Response] = {}

        def ask(name, prompt):
            with server.client() as c:
                replies[name] = c.post("/infer", json={"prompt": prompt, "max_tokens": 2000})

        running = threading.Thread(target=ask, args=("running", long_prompt))
        running.start()
        wait_for(lambda: server.metric("stepserve_requests_running") == 1, what="a running request")
        queued = threading.Thread(target=ask, args=("queued", COUNTING))
        queued.start()
        wait_for(lambda: server.metric("stepserve_requests_waiting") == 1, what="a waiting request")
        with server.client() as client:
            refused = client.post("/infer", json={"prompt": "Hello", "max_tokens": 2})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        running.join()
        queued.join()
        assert replies["running"].status_code == 200, replies["running"].text
        assert replies["running"].json()["finish_reason"] == "timeout"
        # The queued one times out too. Its limit comes about a second after the running one's,
        # when the slot is free again: on a loaded machine it may start in that second and
        # answer 200 with its first tokens and "timeout"; else it never got a token: 504.
        queued_reply = replies["queued"].json()
        if replies["queued"].status_code == 200:
            assert queued_reply["finish_reason"] == "timeout" and "timed out" in queued_reply["error"], queued_reply
        else:
            assert replies["queued"].status_code == 504 and "timed out" in queued_reply["error"]["message"]
        assert server.metric("stepserve_queue_rejections_total", reason="queue_full") == 1
        # The engine records a timeout when it next schedules, after the answer went out. The
        # queued request's limit comes ~1 s after the running one's, once it has the freed slot,
        # so the engine may see it waiting or just started: count both together.
        timeouts = lambda: sum(server.metric("stepserve_timeouts_total", reason=r) for r in ("waiting", "running"))  # noqa: E731
        wait_for(lambda: timeouts() == 2, 30, "both timeouts in the metrics")
        assert server.metric("stepserve_timeouts_total", reason="running") >= 1
        with server.client() as client:
            assert client.post("/infer", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
    finally:
        server.stop()


def test_sigterm_drains_then_exits_0():
    small_server = start_server(DRAIN)
    results: dict[str, object] = {}

    def long_stream():
        with (
            small_server.client() as c,
            c.stream("POST", "/infer", json={"prompt": COUNTING, "max_tokens": 2000, "stream": True}) as r,
        ):
            results["long"] = sse_events(r)[-1]

    def short():
        with small_server.client() as c:
            results["short"] = c.post("/infer", json={"prompt": COUNTING, "max_tokens": 12})

    threads = [threading.Thread(target=long_stream), threading.Thread(target=short)]
    for t in threads:
        t.start()
    wait_for(lambda: small_server.metric("stepserve_requests_running") == 2, what="two running requests")
    small_server.process.send_signal(signal.SIGTERM)
    with small_server.client() as client:
        wait_for(lambda: client.get("/readyz").status_code == 503, 5, "/readyz to turn 503")
        assert client.post("/infer", json={"prompt": "Hello", "max_tokens": 2}).status_code == 503
        assert client.get("/healthz").status_code == 200
    for t in threads:
        t.join()
    assert results["short"].status_code == 200 and results["short"].json()["finish_reason"] == "length"
    assert results["long"]["finish_reason"] == "cancelled"
    assert small_server.process.wait(30) == 0
    assert "draining" in small_server.log()


def test_bench_smoke(server, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            STEPSERVE,
            "bench",
            "--url",
            server.url,
            "--concurrency",
            "1",
            "2",
            "--requests",
            "1",
            "--max-tokens",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    assert all(level["errors"] == 0 and level["aggregate_tok_s"] > 0 for level in report["levels"])
    assert out.with_suffix(".png").stat().st_size > 1000 and report["plot"] == str(out.with_suffix(".png"))


def test_bench_keeps_its_constrained_streams_busy_until_the_free_ones_finish(server, tmp_path):
    out = tmp_path / "constrained.json"
    command = [STEPSERVE, "bench", "--url", server.url, "--api", "openai", "--concurrency", "3"]
    command += ["--requests", "1", "--max-tokens", "24", "--constrained", "1", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    level = json.loads(out.read_text())["levels"][0]
    assert level["errors"] == 0 and level["constrained_requests"] >= 1 and level["grammar_masks"] > 0, level
    assert level["requests"] == 2 + level["constrained_requests"]  # the free streams' one each, and the JSON ones


def test_compile_auto_chooses_per_bucket_and_answers_the_same(server):
    # Few buckets: auto times each bucket's step compiled and eager at warm-up (prompt buckets 32
    # and 64: the chunk steps of 128 and 256 tokens took 12 s of a 26 s warm-up). No rehearsal:
    # the choice is made per bucket before it, and the answer is checked after ready anyway.
    small = ["--capacity-buckets", "[256,512]", "--batch-buckets", "[1,2]", "--prompt-buckets", "[32,64]"]
    small += ["--warmup-batch", "2", "--warmup-rehearsal", "false"]
    auto = ServerProcess.start(["--compile", "auto", "--warmup-prompt-tokens", "32", *small])
    try:
        auto.wait_ready()
        with auto.client() as client:
            ready = client.get("/readyz").json()["models"][MODEL]
            reply = client.post("/infer", json={"prompt": "The sky is", "max_tokens": 8}).json()
        planned = [k for k in ready["buckets"] if not k.startswith(("verify ", "spec_"))]  # (and speculation's)
        assert ready["compile"] == "auto" and ready["warmed"] == len(planned)
        assert ready["compiled"] == sum(choice == "compiled" for choice in ready["buckets"].values())
        assert set(ready["buckets"].values()) <= {"compiled", "eager"} and "decode b1x256" in ready["buckets"]
        gauge = auto.metric("stepserve_compiled_step", phase="decode", bucket="b1x256")
        assert gauge == (1 if ready["buckets"]["decode b1x256"] == "compiled" else 0)
    finally:
        auto.stop()
    with server.client() as client:
        assert client.post("/infer", json={"prompt": "The sky is", "max_tokens": 8}).json()["text"] == reply["text"]


def test_side_by_side_smoke(tmp_path):
    """The side-by-side command runs end to end: both servers, the same load, ratios and a plot.
    stepserve keeps the warm-up the command sets (prompts up to 256 tokens, batch 1) on two
    capacity buckets, without rehearsal: these requests fit 256 positions (28 -> 19 s)."""
    result = subprocess.run(
        [
            STEPSERVE,
            "bench",
            "--side-by-side",
            "--concurrency",
            "1",
            "--requests",
            "1",
            "--max-tokens",
            "4",
            "--out-dir",
            str(tmp_path),
            "--serve-args=--capacity-buckets 256,512 --warmup-rehearsal false",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "side-by-side.json").read_text())
    assert set(report["results"]) == {"stepserve", "mlx_lm.server"}
    assert all(
        r["levels"][0]["errors"] == 0 and r["levels"][0]["completion_tokens"] > 0 for r in report["results"].values()
    )
    assert report["ratios"][0]["aggregate_tok_s"] > 0
    ours = report["results"]["stepserve"]["levels"][0]
    assert ours["warmup_compile_misses"] == 0 and ours["compile_misses"] == 0, "stepserve compiled after its warm-up"
    assert (tmp_path / "side-by-side.png").stat().st_size > 1000
    for name, r in report["results"].items():  # each server's own record, written as it finished
        assert json.loads((tmp_path / f"{name}.json").read_text())["result"] == r


def test_the_bench_report_schema_keeps_a_constrained_row_as_long_as_a_free_one(server):
    """`--constrained-schema report` exists so that constrained streams send as many requests
    per token as free ones: on the default model its JSON is still open at 128 tokens."""
    from service.bench.load import Workload

    workload = Workload("essays", "openai", 128, None, streams=1, constrained=1, schema="report")
    path, body = workload.request(0)
    assert body["response_format"]["json_schema"]["name"] == "report"
    with server.client() as client:
        answer = client.post(path, json=body | {"stream": False, "stream_options": None}).json()
    assert answer["choices"][0]["finish_reason"] == "length", answer
    assert answer["usage"]["completion_tokens"] == 128
    assert answer["choices"][0]["text"].lstrip().startswith('{"title"')
