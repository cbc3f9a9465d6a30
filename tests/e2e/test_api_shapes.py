"""The HTTP API's shapes against real servers: OpenAI's error object on every route,
``finish_reason`` only ``stop``/``length`` on the OpenAI routes (an early end is an error),
``/infer``'s early ends carrying their reason, a time limit that holds while the engine is
busy, the shutdown message at the end of a stream, and ``/docs`` served from local files."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest

from tests.support import ServerProcess

pytestmark = pytest.mark.slow

KEY = "shapes-key-0b5e"
AUTH = {"authorization": f"Bearer {KEY}"}
LIMIT_S = 3  # request_timeout_s of the `limited` server
ROOMY_LIMIT_S = 10  # request_timeout_s of the `roomy` server: first tokens arrive well before it, on any CPU
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # the model keeps counting: no early end-of-sequence
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
ERROR_KEYS = {"message", "type", "param", "code"}


def _serve(args: list[str], env: dict[str, str], kill: bool = False):
    """A ready server, stopped with SIGTERM after its tests (``kill``: SIGKILL, for one whose
    last test leaves its engine in a step that no signal interrupts)."""
    proc = ServerProcess.start(args, env=env)
    try:
        proc.wait_ready()
        yield proc
    finally:
        if kill:
            proc.process.kill()
        proc.stop()


@pytest.fixture(scope="module")
def limited():
    """One slot, a 3 s time limit, few buckets (a cheap warm-up that covers chat prompts up to
    64 tokens; the 2048 bucket is left cold, so a long prompt keeps the engine busy compiling
    and prefilling it), an API key that /docs, its assets and /openapi.json do without. Killed
    after its last test, whose prompt keeps the engine in one eager step for ~20 s more (its
    shutdown is not what is tested here: `roomy`'s is)."""
    env = {
        "STEPSERVE_BATCH_BUCKETS": "[1]",
        "STEPSERVE_PROMPT_BUCKETS": "[64, 2048]",
        "STEPSERVE_CAPACITY_BUCKETS": "[256, 2048, 4096]",
        "STEPSERVE_REQUEST_TIMEOUT_S": str(LIMIT_S),
        "STEPSERVE_API_KEY": KEY,
        "STEPSERVE_AUTH_EXEMPT_PATHS": '["/healthz", "/readyz", "/metrics", "/docs", "/openapi.json"]',
    }
    yield from _serve(["--warmup-prompt-tokens", "32"], env, kill=True)


@pytest.fixture(scope="module")
def roomy():
    """Two slots, a 10 s time limit and no shutdown grace: a counting request has tokens long
    before its limit, and SIGTERM ends what runs at the next step (its last test stops it)."""
    env = {
        "STEPSERVE_BATCH_BUCKETS": "[2]",
        "STEPSERVE_SHUTDOWN_GRACE_S": "0",
        "STEPSERVE_REQUEST_TIMEOUT_S": str(ROOMY_LIMIT_S),
    }
    yield from _serve(["--warmup-prompt-tokens", "32"], env)


def client(server: ServerProcess, **kwargs) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=AUTH, timeout=300, **kwargs)


def wait_idle(server: ServerProcess, timeout: float = 600) -> None:
    """Until the engine runs and queues nothing (a timed-out request may still be prefilling)."""
    deadline = time.monotonic() + timeout
    while server.metric("stepserve_requests_running") + server.metric("stepserve_requests_waiting") > 0:
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.1)


def data_lines(response: httpx.Response) -> list[str]:
    """The payloads of a server-sent event stream's ``data:`` lines, in order."""
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def assert_error(reply: httpx.Response, status: int, param: str | None = None) -> dict:
    """OpenAI's error object and nothing else, ``code`` the status as a string."""
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert error["code"] == str(status) and isinstance(error["message"], str) and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param
    return error


def finish_reasons(payloads: list[str]) -> set:
    return {c["finish_reason"] for p in payloads if p != "[DONE]" for c in json.loads(p).get("choices", [])}


BAD = [
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 422, "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "n": 17}, 422, "n"),
    ("/v1/chat/completions", {**CHAT, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model", "stream": True}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("/infer", {"prompt": "hi", "max_tokens": 0}, 422, "max_tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_errors_are_openai_error_objects(limited, path, body, status, param):
    with client(limited) as c:
        assert_error(c.post(path, json=body), status, param)


def test_a_missing_key_and_a_bad_body_are_openai_error_objects_too(limited):
    with httpx.Client(base_url=limited.url, timeout=60) as c:
        assert_error(c.post("/v1/completions", json={"prompt": "hi"}), 401, "Authorization")
    with client(limited) as c:
        reply = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert_error(reply, 422, "body")


def test_docs_load_their_assets_from_this_server(limited):
    with httpx.Client(base_url=limited.url, timeout=60) as c:  # no key: /docs and its assets are exempt
        page = c.get("/docs")
        assert page.status_code == 200 and "cdn" not in page.text.lower()
        urls = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        scripts = [u for u in urls if u.endswith(".js")]
        assert scripts and all(u.startswith("/") and not u.startswith("//") for u in urls), urls
        for url in urls:
            asset = c.get(url)
            assert asset.status_code == 200 and len(asset.content) > 1000, url
        assert "javascript" in c.get(scripts[0]).headers["content-type"]
        assert c.get("/openapi.json").json()["paths"]
    with client(limited) as c:
        redoc = c.get("/redoc")
        assert redoc.status_code == 200 and "googleapis" not in redoc.text
        (script,) = re.findall(r'<script src="([^"]+)"', redoc.text)
        assert script.startswith("/") and c.get(script).status_code == 200


def test_openai_finish_reason_is_stop_or_length(limited):
    with client(limited) as c:
        whole = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "temperature": 0})
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["finish_reason"] == "length"
        with c.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
            payloads = data_lines(r)
    assert payloads[-1] == "[DONE]" and finish_reasons(payloads) <= {None, "stop", "length"}


def test_openai_requests_past_the_time_limit_answer_an_error(roomy):
    long = {"max_tokens": 4000, "temperature": 0}
    with httpx.Client(base_url=roomy.url, timeout=300) as c:
        error = assert_error(c.post("/v1/completions", json={"prompt": COUNTING, **long}), 504)
        assert "timed out" in error["message"] and error["type"] == "timeout"
        request = {"messages": [{"role": "user", "content": f"Go on: {COUNTING}"}], "stream": True, **long}
        with c.stream("POST", "/v1/chat/completions", json=request) as r:
            assert r.status_code == 200
            payloads = data_lines(r)
    assert payloads[-1] == "[DONE]" and len(payloads) >= 3, payloads  # text, the error, [DONE]
    assert finish_reasons(payloads) == {None}
    last = json.loads(payloads[-2])
    assert set(last) == {"error"} and set(last["error"]) == ERROR_KEYS and last["error"]["code"] == "504"
    assert "timed out" in last["error"]["message"]


def test_infer_past_the_time_limit_keeps_its_text_and_says_why(roomy):
    request = {"prompt": COUNTING, "max_tokens": 4000}
    with httpx.Client(base_url=roomy.url, timeout=300) as c:
        whole = c.post("/infer", json=request)
        with c.stream("POST", "/infer", json={**request, "stream": True}) as r:
            final = json.loads(data_lines(r)[-1])
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["finish_reason"] == "timeout" and "timed out" in body["error"]
    assert body["usage"]["completion_tokens"] > 0
    assert final["finish_reason"] == "timeout" and "timed out" in final["error"]


def test_a_shutdown_ends_streams_with_its_message(roomy):
    requests = {
        "infer": ("/infer", {"prompt": COUNTING, "max_tokens": 2000, "stream": True}),
        "chat": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": COUNTING}], "max_tokens": 2000, "stream": True},
        ),
    }
    started = {name: threading.Event() for name in requests}
    results: dict[str, list[str] | BaseException] = {}

    def read(name: str) -> None:
        path, body = requests[name]
        payloads: list[str] = []
        try:
            with httpx.Client(base_url=roomy.url, timeout=300) as c, c.stream("POST", path, json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        payloads.append(line[6:])
                        started[name].set()
            results[name] = payloads
        except BaseException as exc:
            results[name] = exc
            started[name].set()

    threads = [threading.Thread(target=read, args=(name,)) for name in requests]
    for t in threads:
        t.start()
    for event in started.values():
        assert event.wait(300), "a stream never started"
    roomy.process.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert roomy.process.wait(60) == 0
    infer, chat = results["infer"], results["chat"]
    assert isinstance(infer, list) and isinstance(chat, list), results
    final = json.loads(infer[-1])
    assert final["finish_reason"] == "cancelled" and final["error"] == "server shutting down", final
    assert chat[-1] == "[DONE]" and finish_reasons(chat) == {None}
    assert json.loads(chat[-2]) == {
        "error": {"message": "server shutting down", "type": "unavailable", "param": None, "code": "503"}
    }


def test_the_time_limit_holds_while_the_engine_is_busy(limited):
    """A prompt of ~1900 tokens: compiling its cold prefill bucket and prefilling it keep the
    engine busy past the 3 s limit, yet the answer comes while the engine is still on it.
    (Last: the engine stays busy a while after it.)"""
    with client(limited) as c:
        wait_idle(limited)
        reply = c.post("/v1/completions", json={"prompt": "lorem ipsum " * 370 + COUNTING, "max_tokens": 16})
        still_busy = limited.metric("stepserve_requests_running") == 1
    error = assert_error(reply, 504)
    assert "before its first token" in error["message"]
    assert still_busy, "the engine finished the prefill before the limit: the prompt is too short to test this"
