"""Faults against real `stepserve serve` processes: damaged model files, a request over MLX's
memory limit, the engine thread dying, and clients whose body is slow, stalled or endless."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from models.default import default_model_path
from service.bench.servers import free_port
from service.process.watchdog import ENGINE_DIED_EXIT
from tests.support import STEPSERVE, ServerProcess, damaged

SHORT = {"prompt": "The sky is", "max_tokens": 2}
MEMORY_LIMIT = 700_000_000  # above the weights (538 MB dequantized here) + a short request, below a long one
READ_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def gguf_bytes() -> bytes:
    return default_model_path().read_bytes()


@pytest.mark.parametrize("kind", ["key-length", "empty"])
def test_corrupt_model_file_fails_start_up_naming_the_file(tmp_path, gguf_bytes, kind):
    # Without the layout check, "key-length" killed the process with SIGSEGV and no message.
    path = tmp_path / f"{kind}.gguf"
    path.write_bytes(b"" if kind == "empty" else damaged(gguf_bytes, kind))
    result = subprocess.run(
        [STEPSERVE, "serve", "--model", str(path), "--port", "0"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert str(path) in result.stderr and "corrupt" in result.stderr


@pytest.fixture(scope="module")
def limited_server():
    """Memory limit 700 MB (the start-up budget set far above it, so only admission guards
    memory), read timeout 2 s, no warm-up."""
    env = {
        "STEPSERVE_MLX_MEMORY_LIMIT_BYTES": str(MEMORY_LIMIT),
        "STEPSERVE_MEMORY_BUDGET_BYTES": str(100 * 10**9),
        "STEPSERVE_READ_TIMEOUT_S": str(READ_TIMEOUT_S),
    }
    proc = ServerProcess.start(["--warmup-prompt-tokens", "0"], env=env)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_request_over_the_memory_limit_gets_503_and_the_server_keeps_serving(limited_server):
    with limited_server.client() as client:
        assert client.post("/infer", json=SHORT).status_code == 200
        reply = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8000})
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["param"] == "max_tokens" and "memory limit" in error["message"] and "0.70 GB" in error["message"]
        assert client.post("/infer", json=SHORT).status_code == 200
    assert limited_server.metric("stepserve_queue_rejections_total", reason="memory") == 1


class Exchange(NamedTuple):
    """What :func:`raw_request` saw: the server's answer (all it sent before closing), the
    seconds until it closed, and how many of the parts were sent before it answered."""

    answer: bytes
    seconds: float
    sent: int


def raw_request(port: int, head: bytes, parts: list[bytes], pause_s: float = 0.0, timeout: float = 30) -> Exchange:
    """Send ``head`` then each part (``pause_s`` apart) until the server answers or closes;
    read until it closes."""
    start = time.monotonic()
    answer, sent = b"", 0
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        try:
            for part in parts:
                # Stop sending once the server has answered: more bytes after it closes make
                # the kernel reset the connection, which can discard the answer unread.
                if select.select([sock], [], [], 0)[0]:
                    break
                sock.sendall(part)
                sent += 1
                time.sleep(pause_s)
        except OSError:  # the server closed first
            pass
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:  # closed with our unread bytes pending: keep what arrived
            pass
    return Exchange(answer, time.monotonic() - start, sent)


# The read-timeout tests assert an upper bound with this margin, or an order of events, never a
# lower bound on elapsed time: that a slow client is not cut off early is shown by one that
# finishes inside the timeout being served. A trickle lasts TRICKLE_S, far past the timeout, so
# an answer that comes while it is still sending shows the trickle did not extend the timeout.
MARGIN_S = 10
TRICKLE_S = 30


def test_a_slow_client_that_finishes_within_the_read_timeout_is_served(limited_server):
    # Headers in three parts and the body in three more, 0.25 s apart: each of the two clocks
    # (headers from the connection, body from the headers) sees ~0.5-0.75 s of its 2 s.
    body = json.dumps(SHORT).encode()
    head = b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n"
    head += b"content-length: %d\r\n\r\n" % len(body)
    third = len(body) // 3
    parts = [head[:16], head[16:40], head[40:], body[:third], body[third : 2 * third], body[2 * third :]]
    answer, _, sent = raw_request(limited_server.port, b"", parts, pause_s=0.25, timeout=300)
    assert sent == len(parts) and answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_stalled_body_gets_408_after_the_read_timeout(limited_server):
    head = b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    answer, seconds, _ = raw_request(limited_server.port, head, [b'{"prompt": "a'])
    assert answer.startswith(b"HTTP/1.1 408") and b"read_timeout_s" in answer
    assert seconds < READ_TIMEOUT_S + MARGIN_S


def test_trickled_body_is_bounded_by_the_read_timeout_too(limited_server):
    head = b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
    parts = [b" "] * int(TRICKLE_S / 0.1)  # 1 byte / 100 ms
    answer, _, sent = raw_request(limited_server.port, head, parts, pause_s=0.1)
    assert answer.startswith(b"HTTP/1.1 408") and b"read_timeout_s" in answer
    assert sent < len(parts)  # answered mid-trickle: each byte did not restart the clock


def test_idle_connection_is_closed_after_the_read_timeout(limited_server):
    answer, seconds, _ = raw_request(limited_server.port, b"", [])
    assert answer == b""
    assert seconds < READ_TIMEOUT_S + MARGIN_S


def test_trickled_headers_are_cut_off_by_the_read_timeout(limited_server):
    lines = [b"GET /healthz HTTP/1.1\r\n", b"host: x\r\n"] + [b"x-a: b\r\n"] * int(TRICKLE_S / 0.1)
    answer, _, sent = raw_request(limited_server.port, b"", lines, pause_s=0.1)  # a header line / 100 ms
    assert answer == b""
    assert sent < len(lines)  # closed mid-trickle: each line did not restart the clock


def test_endless_chunked_body_gets_413(limited_server):
    head = b"POST /infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (65536, b"a" * 65536)
    answer, _, _ = raw_request(limited_server.port, head, [chunk] * 64)  # 4 MiB, over the 1 MiB limit
    assert answer.startswith(b"HTTP/1.1 413") and b"max_body_bytes" in answer
    with limited_server.client() as client:
        assert client.post("/infer", json=SHORT).status_code == 200


# -- the engine thread dying ---------------------------------------------------------------------------

# Runs `stepserve serve` with the engine thread made to die at its third scheduling step with
# a request running: an exception that escapes the loop's `except Exception`, as a bug in its
# error path would.
DYING_ENGINE = """
import sys
import models
from service.engine.scheduler import Scheduler

class InjectedFault(BaseException):
    pass

original, steps = Scheduler.schedule, []

def schedule(self, *args, **kwargs):
    if self.running:
        steps.append(1)
        if len(steps) == 3:
            raise InjectedFault("injected engine fault")
    return original(self, *args, **kwargs)

Scheduler.schedule = schedule
from service.cli import main
sys.exit(main())
"""


# The same with warm-up failing: the engine thread logs why and ends before it is ready.
FAILING_WARMUP = """
import sys
import models
from service.engine.executor import Executor

def warm(self, *args, **kwargs):
    raise RuntimeError("injected warm-up fault")

Executor.warm = warm
from service.cli import main
sys.exit(main())
"""


def start_with(code: str, args: list[str]) -> ServerProcess:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="stepserve-", suffix=".log")[1])
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )
    return ServerProcess(proc, port, log)


def test_engine_thread_death_fails_readyz_and_exits_non_zero():
    server = start_with(DYING_ENGINE, ["--warmup-prompt-tokens", "0"])
    try:
        server.wait_ready()
        replies: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda: replies.append(
                httpx.post(f"{server.url}/infer", json={"prompt": "1, 2, 3,", "max_tokens": 50}, timeout=60)
            )
        )
        worker.start()
        readyz = []
        with httpx.Client(base_url=server.url, timeout=5) as client:
            while server.process.poll() is None:
                try:
                    readyz.append(client.get("/readyz"))
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
        worker.join(30)
        assert server.process.wait(60) == ENGINE_DIED_EXIT, server.log()
    finally:
        server.stop()
    assert replies and replies[0].status_code == 500, replies
    assert "engine thread died" in replies[0].json()["error"]["message"]
    assert any(r.status_code == 503 and "engine thread died" in r.text for r in readyz), [r.text for r in readyz[-5:]]
    assert "engine thread of model 'SmolLM2-135M-Instruct' died" in server.log()


def test_failed_warm_up_exits_non_zero_instead_of_staying_unready():
    server = start_with(FAILING_WARMUP, ["--warmup-prompt-tokens", "32"])
    try:
        assert server.process.wait(120) == ENGINE_DIED_EXIT, server.log()
    finally:
        server.stop()
    assert "warm-up failed" in server.log() and "died" in server.log()
