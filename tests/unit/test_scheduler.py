"""The scheduler alone: FCFS admission, caps, cancellation, time limits and draining."""

import pytest

from service.engine.scheduler import DrainingError, QueueFullError, Scheduler
from service.engine.sequence import FinishReason, SamplingParams, Sequence


def seq(name: str, deadline: float | None = None) -> Sequence:
    s = Sequence([1, 2, 3], SamplingParams(), detokenizer=None, emit=lambda e: None, request_id=name)
    s.deadline = deadline
    return s


def names(items):
    return [s.request_id for s in items]


def test_admits_in_arrival_order_up_to_the_running_cap():
    sched = Scheduler(max_running=3, max_waiting=10, max_admit=2)
    for name in "abcde":
        sched.add(seq(name))
    assert names(sched.schedule(now=0).admitted) == ["a", "b"]  # at most max_admit per step
    assert names(sched.schedule(now=0).admitted) == ["c"]  # the running cap
    assert sched.schedule(now=0).admitted == []
    sched.finish(sched.running[0])
    assert names(sched.schedule(now=0).admitted) == ["d"]  # FCFS: d before e


def test_full_queue_refuses():
    sched = Scheduler(max_running=1, max_waiting=2, max_admit=1)
    sched.add(seq("a"))
    sched.add(seq("b"))
    with pytest.raises(QueueFullError, match="full"):
        sched.add(seq("c"))


def test_cancelled_and_timed_out_requests_leave_at_the_next_step():
    sched = Scheduler(max_running=2, max_waiting=10, max_admit=2)
    running, waiting_late, queued = seq("run"), seq("late", deadline=5.0), seq("q")
    sched.add(running)
    sched.schedule(now=0)
    sched.add(waiting_late)
    sched.add(queued)
    sched.cancel(running)
    out = sched.schedule(now=6.0)
    assert [(s.request_id, r) for s, r in out.aborted] == [
        ("late", FinishReason.TIMEOUT),
        ("run", FinishReason.CANCELLED),
    ]
    assert names(out.admitted) == ["q"] and names(sched.running) == ["q"]


def test_draining_refuses_new_requests_but_keeps_queued_ones():
    sched = Scheduler(max_running=1, max_waiting=10, max_admit=1)
    sched.add(seq("a"))
    sched.drain()
    with pytest.raises(DrainingError):
        sched.add(seq("b"))
    assert names(sched.schedule(now=0).admitted) == ["a"]
    assert names(sched.abort_all(FinishReason.CANCELLED)) == ["a"] and sched.num_running == 0
