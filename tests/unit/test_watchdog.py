"""The engine watchdog of a pipeline group's rank 0 once `stepserve launch` has reported
another rank gone (:meth:`EngineWatchdog.peer_lost`): a wait on the group stuck past
LOST_RANK_STALL_S fails the requests with an error naming the rank, long before the stall
limit; without that report the same wait is within the limit. An embedding model's thread that
dies, or is stuck in a step far past what its steps take, is failed as an engine's: the request
it held answers 500 naming it, the next 503 (not ready), and the process is stopped."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import mlx.core as mx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from service.api.app import create_app
from service.config import Settings
from service.engine.compile_cache import CompileCache
from service.engine.embedder import Embedder
from service.metrics import Metrics
from service.process import watchdog as wd


class StuckEngine:
    """An engine whose thread waits on the group (``stalled`` seconds so far) and records fail()."""

    def __init__(self, stalled: float):
        self.executor = SimpleNamespace(stalled_s=lambda: stalled)
        self.model = SimpleNamespace(name="tiny")
        self.ready = SimpleNamespace(is_set=lambda: True)
        self.alive = True
        self.failed: list[tuple[str, str]] = []

    def fail(self, message: str, reason: str = "") -> None:
        self.failed.append((message, reason))


def test_a_reported_lost_rank_fails_a_stuck_wait_with_its_name(monkeypatch):
    exits = []
    monkeypatch.setattr(wd.os, "_exit", exits.append)
    engine = StuckEngine(stalled=wd.LOST_RANK_STALL_S + 0.1)
    watchdog = wd.EngineWatchdog({"tiny": engine}, shutdown_grace_s=30, linger_s=0, stall_limit_s=30)  # type: ignore[dict-item]
    assert not watchdog._stalled(engine)  # type: ignore[arg-type]  # a slow step, as far as it knows
    watchdog.peer_lost("rank 1 exited with code -9")
    assert watchdog._stalled(engine)  # type: ignore[arg-type]
    watchdog._fail_hung([engine])  # type: ignore[list-item]
    message, reason = engine.failed[0]
    assert "rank 1 exited with code -9" in message and message.startswith("the pipeline group failed")
    assert reason == "pipeline group lost" and exits == [wd.ENGINE_DIED_EXIT]


def test_after_the_report_an_engine_between_waits_is_left_alone():
    engine = StuckEngine(stalled=0.0)  # computing, or idle: its next collective raises or stalls
    watchdog = wd.EngineWatchdog({"tiny": engine}, shutdown_grace_s=30, stall_limit_s=30)  # type: ignore[dict-item]
    watchdog.peer_lost("rank 1 was killed")
    assert not watchdog._stalled(engine)  # type: ignore[arg-type]


class ThreadDeath(BaseException):
    """Escapes the embedder's loop (which catches Exception): its thread ends."""


class BlockingEncoder:
    """An encoder whose call signals ``entered``, waits for ``go``, then raises ``crash`` (None:
    returns zeros). The first ``free`` calls return zeros at once."""

    name, dimensions, dtype, nbytes = "emb", 4, mx.float32, 0
    args = SimpleNamespace(vocab_size=100, step_bytes=lambda batch, length, itemsize: 0)  # no memory to admit

    def __init__(self, crash: BaseException | None, free: int = 0):
        self.entered, self.go, self.crash, self.free = threading.Event(), threading.Event(), crash, free

    def embed(self, ids, mask):
        if self.free:
            self.free -= 1
            return mx.zeros((ids.shape[0], self.dimensions))
        self.entered.set()
        self.go.wait()
        if self.crash is not None:
            raise self.crash
        return mx.zeros((ids.shape[0], self.dimensions))


def started_embedder(encoder: BlockingEncoder) -> Embedder:
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    cache = CompileCache("off", metrics.record_lookup, metrics.record_compile)
    embedder = Embedder(encoder, (1,), (8,), cache, metrics)  # type: ignore[arg-type]
    embedder.start([])
    assert embedder.ready.wait(30)
    return embedder


def test_a_failed_embedding_step_fails_its_requests_only():
    encoder = BlockingEncoder(RuntimeError("a failed step"))
    embedder = started_embedder(encoder)
    encoder.go.set()
    try:
        with pytest.raises(RuntimeError, match="a failed step"):
            embedder.submit([[1, 2]]).result(30)
        assert embedder.alive  # nothing for the watchdog to do
    finally:
        embedder.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_embedding_thread_fails_its_requests_and_stops_the_server(monkeypatch):
    signals, stopped = [], threading.Event()
    monkeypatch.setattr(wd.os, "kill", lambda pid, sig: (signals.append(sig), stopped.set()))
    monkeypatch.setattr(wd.os, "_exit", lambda code: None)  # the drain's backstop
    app = create_app(Settings.model_validate({}))  # its lifespan does not run: the embedder is put in by hand
    encoder = BlockingEncoder(ThreadDeath())
    embedders = app.state.stepserve.embedders
    embedders["emb"] = embedder = started_embedder(encoder)
    watchdog = wd.EngineWatchdog({}, shutdown_grace_s=0, poll_s=0.01, linger_s=0, embedders=embedders)
    watchdog.start()
    client = TestClient(app)
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(client.post, "/v1/embeddings", json={"model": "emb", "input": [[1, 2, 3]]})
            assert encoder.entered.wait(30)
            encoder.go.set()  # the thread dies mid-step, the request still held
            assert stopped.wait(30)
            reply = held.result(30)
        later = client.post("/v1/embeddings", json={"model": "emb", "input": [[1, 2, 3]]})
    finally:
        watchdog.stop()
        embedder.stop()
    assert reply.status_code == 500 and "embedding thread died" in reply.json()["error"]["message"]
    assert later.status_code == 503 and "embedding thread died" in later.json()["error"]["message"]
    assert signals == [signal.SIGTERM] and watchdog.exit_code == wd.ENGINE_DIED_EXIT
    assert not embedder.ready.is_set() and embedder.not_ready_reason == "embedding thread died"


def serve_stuck_step(monkeypatch, encoder: BlockingEncoder, warm_requests: int = 0):
    """Serve ``encoder`` behind the app with a watchdog, make ``warm_requests`` requests, then one
    whose step blocks; returns (its reply, a request's reply after the failure, the SIGTERMs
    sent, the watchdog, the embedder, the stuck step's expected seconds). The encoder is
    released once the watchdog has failed the embedder."""
    signals, stopped = [], threading.Event()
    monkeypatch.setattr(wd.os, "kill", lambda pid, sig: (signals.append(sig), stopped.set()))
    monkeypatch.setattr(wd.os, "_exit", lambda code: None)  # the drain's backstop
    app = create_app(Settings.model_validate({}))  # its lifespan does not run: the embedder is put in by hand
    embedders = app.state.stepserve.embedders
    embedders["emb"] = embedder = started_embedder(encoder)
    watchdog = wd.EngineWatchdog({}, shutdown_grace_s=0, poll_s=0.01, linger_s=0, embedders=embedders)
    watchdog.start()
    client = TestClient(app)
    body = {"model": "emb", "input": [[1, 2, 3]]}
    try:
        for _ in range(warm_requests):
            assert client.post("/v1/embeddings", json=body).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(client.post, "/v1/embeddings", json=body)
            assert encoder.entered.wait(30)
            expected = embedder.clock.expected_s()
            assert stopped.wait(60)  # the watchdog saw the step outlast its limit
            assert embedder.alive  # stuck, not dead
            reply = held.result(30)
        later = client.post("/v1/embeddings", json=body)
    finally:
        watchdog.stop()
        encoder.go.set()  # the stuck step finishes after all: its results are dropped
        embedder.stop()
    return reply, later, signals, watchdog, embedder, expected


def test_a_stuck_first_embedding_step_fails_its_requests_and_stops_the_server(monkeypatch):
    monkeypatch.setattr(wd, "EMBED_STALL_UNKNOWN_S", 0.05)  # no step timed yet: the rate is unknown
    encoder = BlockingEncoder(None)
    reply, later, signals, watchdog, embedder, expected = serve_stuck_step(monkeypatch, encoder)
    assert expected is None
    assert reply.status_code == 500 and "step has not finished" in reply.json()["error"]["message"]
    assert later.status_code == 503 and wd.EMBEDDER_STALLED in later.json()["error"]["message"]
    assert signals == [signal.SIGTERM] and watchdog.exit_code == wd.ENGINE_DIED_EXIT
    assert embedder.not_ready_reason == wd.EMBEDDER_STALLED
    assert embedder._thread is not None
    embedder._thread.join(30)
    assert not embedder.alive  # released, the thread ended instead of serving on


def test_a_stuck_step_after_timed_ones_is_caught_by_its_expected_time(monkeypatch):
    monkeypatch.setattr(wd, "EMBED_STALL_UNKNOWN_S", 1e9)  # never: only the timed steps' rate can catch it
    monkeypatch.setattr(wd, "EMBED_STALL_MIN_S", 0.0)
    encoder = BlockingEncoder(None, free=2)
    reply, later, signals, _, embedder, expected = serve_stuck_step(monkeypatch, encoder, warm_requests=2)
    assert embedder.seconds_per_token is not None and expected == embedder.seconds_per_token * 1 * 8  # b1x8
    assert reply.status_code == 500 and "step has not finished" in reply.json()["error"]["message"]
    assert later.status_code == 503 and signals == [signal.SIGTERM]


def test_a_slow_step_within_its_limit_is_left_alone(monkeypatch):
    encoder = BlockingEncoder(None)
    embedder = started_embedder(encoder)
    watchdog = wd.EngineWatchdog({}, shutdown_grace_s=0, embedders={"emb": embedder})
    try:
        future = embedder.submit([[1, 2]])
        assert encoder.entered.wait(30)
        assert not watchdog._embedder_stalled(embedder)  # 600 s for a step of unknown rate
        monkeypatch.setattr(wd, "EMBED_STALL_UNKNOWN_S", 0.0)
        assert watchdog._embedder_stalled(embedder)
        encoder.go.set()
        assert future.result(30).shape == (1, 4)
    finally:
        encoder.go.set()
        embedder.stop()
