"""Event delivery from the engine thread to the event loop (service/api/events.py): events
reach their queues in order, a burst wakes the loop once, and a generation's deadline ends it
with a timeout after what arrived before it."""

from __future__ import annotations

import asyncio
import threading
import time

from service.api.events import EventSink, Generation
from service.engine.sequence import FinalEvent, FinishReason, SamplingParams, Sequence, TokenEvent


class FakeEngine:
    """What a generation calls on its engine: cancel."""

    def __init__(self):
        self.cancelled: list[tuple[Sequence, FinishReason]] = []

    def cancel(self, seq, reason=FinishReason.CANCELLED):
        self.cancelled.append((seq, reason))


def test_events_from_another_thread_arrive_in_order_with_one_wakeup_per_burst():
    async def main():
        loop = asyncio.get_running_loop()
        sink = EventSink(loop)
        wakeups = 0
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            nonlocal wakeups
            wakeups += 1
            return original(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        queues = [asyncio.Queue() for _ in range(4)]

        def engine():  # one burst: 100 tokens for each of 4 requests
            for t in range(100):
                for q in queues:
                    sink.put(q, TokenEvent(str(t), t))

        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()
        received = [[(await q.get()).token_id for _ in range(100)] for q in queues]
        assert received == [list(range(100))] * 4
        assert 1 <= wakeups < 10  # one wake-up for the burst (plus any racing the drain), not 400

    asyncio.run(main())


def generation(engine: FakeEngine, timeout_s: float) -> Generation:
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=4), None, lambda e: None)
    return Generation(engine, seq, asyncio.Queue(), timeout_s, time.perf_counter() + timeout_s)  # type: ignore[arg-type]


def test_the_deadline_ends_a_generation_with_a_timeout_after_what_came_before():
    async def main():
        engine = FakeEngine()
        gen = generation(engine, 0.05)
        gen.arm()
        gen.events.put_nowait(TokenEvent("a", 7))
        assert (await gen.next()).token_id == 7  # type: ignore[union-attr]
        final = await asyncio.wait_for(gen.next(), 5)
        assert isinstance(final, FinalEvent) and final.finish_reason is FinishReason.TIMEOUT
        assert "timed out after 0.05 s" in (final.error or "")
        assert engine.cancelled == [(gen.seq, FinishReason.TIMEOUT)]
        assert gen.done

    asyncio.run(main())


def test_ready_returns_what_is_queued_up_to_the_final_event():
    async def main():
        gen = generation(FakeEngine(), 60)
        gen.arm()
        final = FinalEvent(FinishReason.STOP, 3, 2, 0.0, 0.1, 0.1, 0.2)
        for event in (TokenEvent("a", 1), TokenEvent("b", 2), final, TokenEvent("late", 3)):
            gen.events.put_nowait(event)
        assert gen.ready() == [TokenEvent("a", 1), TokenEvent("b", 2), final]
        assert gen.done and gen.ready() == []

    asyncio.run(main())
