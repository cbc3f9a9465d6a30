"""The engine watchdog of a pipeline group's rank 0 once `stepserve launch` has reported
another rank gone (:meth:`EngineWatchdog.peer_lost`): a wait on the group stuck past
LOST_RANK_STALL_S fails the requests with an error naming the rank, long before the stall
limit; without that report the same wait is within the limit."""

from __future__ import annotations

from types import SimpleNamespace

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
