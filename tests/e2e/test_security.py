"""Security against a real server: the API key, CORS, the loopback bind, no stack traces in errors, the prompt bound."""

from __future__ import annotations

import time

import anthropic
import httpx
import pytest

from models.default import default_model_path
from service.api.security import is_loopback
from service.config import Settings
from tests.support import ServerProcess

KEY = "test-key-7f3a9c"
ORIGIN = "https://app.example"
SHORT = {"prompt": "The sky is", "max_tokens": 2}
PROTECTED = [
    ("GET", "/v1/models"),
    ("GET", "/readyz"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("POST", "/infer"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/no-such-route"),
]


@pytest.fixture(scope="module")
def locked_server():
    """API key required except on /healthz and /metrics; CORS for one origin; no warm-up."""
    env = {
        "STEPSERVE_API_KEY": KEY,
        "STEPSERVE_AUTH_EXEMPT_PATHS": '["/healthz", "/metrics"]',
        "STEPSERVE_CORS_ORIGINS": f'["{ORIGIN}"]',
    }
    proc = ServerProcess.start(["--warmup-prompt-tokens", "0"], env=env)
    try:
        _wait_ready_with_key(proc)
        yield proc
    finally:
        proc.stop()


def _wait_ready_with_key(proc: ServerProcess) -> None:
    """ServerProcess.wait_ready, with the key /readyz needs here."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.process.poll() is None, proc.log()
        try:
            if (
                httpx.get(f"{proc.url}/readyz", headers={"authorization": f"Bearer {KEY}"}, timeout=5).status_code
                == 200
            ):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(proc.log())


@pytest.mark.parametrize("method,path", PROTECTED)
def test_every_route_needs_the_api_key(locked_server, method, path):
    with locked_server.client() as client:
        reply = client.request(method, path, json=SHORT if method == "POST" else None)
    assert reply.status_code == 401, reply.text
    assert reply.json()["error"] == {
        "message": "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
        "type": "authentication_error",
        "param": "Authorization",
        "code": "401",
    }
    assert reply.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "header", [f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer", f"Bearer  x{KEY}", f"Basic {KEY}", KEY, f"Token {KEY}"]
)
def test_a_wrong_key_or_scheme_is_refused(locked_server, header):
    with locked_server.client() as client:
        assert client.post("/infer", json=SHORT, headers={"authorization": header}).status_code == 401


def test_the_right_key_is_served_and_exempt_paths_need_none(locked_server):
    with locked_server.client() as client:
        for scheme in ("Bearer", "bearer"):
            assert client.post("/infer", json=SHORT, headers={"authorization": f"{scheme} {KEY}"}).status_code == 200
        assert client.get("/healthz").status_code == 200
        assert client.get("/metrics").status_code == 200
    assert locked_server.metric("stepserve_requests_total", status="401") >= 1


def test_anthropic_clients_send_the_key_as_x_api_key(locked_server):
    messages = {"model": "SmolLM2-135M-Instruct", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    right = anthropic.Anthropic(base_url=locked_server.url, api_key=KEY, max_retries=0, timeout=300)
    assert right.messages.create(**messages).usage.output_tokens >= 1  # the client sends x-api-key
    with pytest.raises(anthropic.AuthenticationError) as refused:
        right.with_options(api_key=KEY + "x").messages.create(**messages)
    assert refused.value.status_code == 401
    assert refused.value.body == {
        "type": "error",
        "error": {
            "type": "authentication_error",
            "message": "missing or invalid API key: send the header 'x-api-key: <key>' or "
            "'Authorization: Bearer <key>'",
        },
    }
    with locked_server.client() as client:
        assert client.post("/infer", json=SHORT, headers={"x-api-key": KEY}).status_code == 200  # on every route
        assert client.post("/v1/messages", json=messages).status_code == 401
        bearer = {"authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"}
        assert client.post("/v1/messages", json=messages, headers=bearer).status_code == 200


def test_cors_answers_the_configured_origin_only(locked_server):
    preflight = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization,content-type",
    }
    with locked_server.client() as client:
        allowed = client.options("/infer", headers={"origin": ORIGIN, **preflight})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
        other = client.options("/infer", headers={"origin": "https://evil.example", **preflight})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        refused = client.post("/infer", json=SHORT, headers={"origin": ORIGIN})  # a browser can read why
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_cors_is_off_unless_configured(server):
    with server.client() as client:
        preflight = client.options("/infer", headers={"origin": ORIGIN, "access-control-request-method": "POST"})
        simple = client.get("/v1/models", headers={"origin": ORIGIN})
    assert preflight.status_code == 405
    assert (
        "access-control-allow-origin" not in preflight.headers and "access-control-allow-origin" not in simple.headers
    )


def test_binds_loopback_by_default(server):
    assert Settings().host == "127.0.0.1" and is_loopback(Settings().host)
    assert f"Uvicorn running on http://127.0.0.1:{server.port}" in server.log()


LEAKS = ("Traceback", 'File "', "site-packages", ".py", "/work/", "/tmp/", str(default_model_path().parent))

BAD_REQUESTS = [
    ("GET", "/no-such-route", None, None, 404),
    ("DELETE", "/infer", None, None, 405),
    ("POST", "/infer", b"{not json", "application/json", 422),
    ("POST", "/infer", b"[" * 100_000, "application/json", 400),  # nesting deeper than Python's recursion limit
    ("POST", "/infer", b'{"prompt": "\xff\xfe"}', "application/json", 400),  # not UTF-8
    ("POST", "/infer", b"prompt=hi", "application/x-www-form-urlencoded", 422),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', "application/json", 422),
    ("POST", "/infer", b'{"prompt": "hi", "model": "../../etc/passwd"}', "application/json", 404),
    ("POST", "/infer", b'{"prompt": "' + b"a" * 400_000 + b'"}', "application/json", 400),
    ("POST", "/infer", b'{"prompt": "' + b"a" * (2 << 20) + b'"}', "application/json", 413),
    ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 100000}', "application/json", 400),
    (
        "POST",
        "/infer",
        b'{"prompt": "hi", "stop": ["' + b"x" * 513 + b'"]}',
        "application/json",
        422,
    ),  # costly per token
]


@pytest.mark.parametrize("method,path,body,content_type,status", BAD_REQUESTS)
def test_errors_show_no_stack_traces_or_file_paths(server, method, path, body, content_type, status):
    headers = {"content-type": content_type} if content_type else {}
    with server.client() as client:
        reply = client.request(method, path, content=body, headers=headers)
        assert reply.status_code == status, reply.text
        assert reply.status_code < 500 and reply.json()["error"]["param"] in (
            None,
            "body",
            "prompt",
            "model",
            "max_tokens",
            "messages",
            "messages.0.content",
            "stop",
        )
        for leak in LEAKS:
            assert leak not in reply.text, f"{leak!r} in {reply.text[:300]}"
        assert client.post("/infer", json=SHORT).status_code == 200


def test_prompt_over_the_character_bound_is_refused_before_tokenizing(server):
    with server.client() as client:
        reply = client.post("/infer", json={"prompt": "a" * 700_000})  # 8192 x 81 = 663,552 characters at most
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "prompt"
    assert "700000 characters" in error["message"] and "8192 tokens" in error["message"]
