"""The scheduler alone: FCFS admission, caps, cancellation, time limits and draining."""

import pytest

from service.engine.scheduler import DrainingError, QueueFullError, Scheduler
from service.engine.sequence import FinishReason, SamplingParams, Sequence


def seq(name: str, deadline: float | None = None) -> Sequence:
    s = Sequence([1, 2, 3], SamplingParams(), detokenizer=None, emit=lambda e: None, request_id=name)
    s.deadline = deadline
    return s


def prefilled(sched: Scheduler) -> None:
    """What the runner does once a running request's prompt is prefilled."""
    for s in sched.running:
        s.num_computed = len(s.prompt_ids)


def names(items):
    return [s.request_id for s in items]


def test_admits_in_arrival_order_up_to_the_running_cap():
    sched = Scheduler(max_running=3, max_waiting=10, chunk_tokens=4, max_batched_tokens=6)
    for name in "abcde":
        sched.add(seq(name))
    assert names(sched.schedule(now=0).admitted) == ["a", "b"]  # 3-token prompts: the budget holds two
    prefilled(sched)
    assert names(sched.schedule(now=0).admitted) == ["c"]  # the running cap
    prefilled(sched)
    assert sched.schedule(now=0).admitted == []
    sched.finish(sched.running[0])
    assert names(sched.schedule(now=0).admitted) == ["d"]  # FCFS: d before e


def test_full_queue_refuses():
    sched = Scheduler(max_running=1, max_waiting=2)
    sched.add(seq("a"))
    sched.add(seq("b"))
    with pytest.raises(QueueFullError, match="full"):
        sched.add(seq("c"))


def test_cancelled_and_timed_out_requests_leave_at_the_next_step():
    sched = Scheduler(max_running=2, max_waiting=10)
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
    sched = Scheduler(max_running=1, max_waiting=10)
    sched.add(seq("a"))
    sched.drain()
    with pytest.raises(DrainingError):
        sched.add(seq("b"))
    assert names(sched.schedule(now=0).admitted) == ["a"]
    assert names(sched.abort_all(FinishReason.CANCELLED)) == ["a"] and sched.num_running == 0


def test_long_prompts_advance_one_chunk_per_step_within_the_token_budget():
    sched = Scheduler(max_running=4, max_waiting=10, chunk_tokens=8, max_batched_tokens=12)
    decoding = Sequence([1] * 3, SamplingParams(), detokenizer=None, emit=lambda e: None, request_id="d")
    long = Sequence(list(range(20)), SamplingParams(), detokenizer=None, emit=lambda e: None, request_id="long")
    short = seq("short")
    for s in (decoding, long, short):
        sched.add(s)
    first = sched.schedule(now=0)
    assert names(first.prefill) == ["d", "long"]  # 3 + 8 tokens; the short one (3) would pass 12
    decoding.num_computed, long.num_computed = 3, 8
    second = sched.schedule(now=0)  # 1 decode row + long's next chunk (8) + short (3) = 12
    assert names(second.prefill) == ["long", "short"] and names(second.admitted) == ["short"]
    long.num_computed, short.num_computed = 16, 3
    assert names(sched.schedule(now=0).prefill) == ["long"]  # its last 4 tokens
    long.num_computed = 20
    assert sched.schedule(now=0).prefill == []  # everyone decodes


def test_a_chunk_over_the_budget_still_runs_when_it_is_the_only_one():
    sched = Scheduler(max_running=2, max_waiting=10, chunk_tokens=64, max_batched_tokens=16)
    sched.add(Sequence(list(range(40)), SamplingParams(), detokenizer=None, emit=lambda e: None, request_id="big"))
    assert names(sched.schedule(now=0).prefill) == ["big"]
