"""Delivery of the engine's events to the event loop, and one request's view of them.

The engine thread emits an event per token per request. Each ``loop.call_soon_threadsafe``
wakes the event loop through its self-pipe (a system call on each side), so an
:class:`EventSink` batches: the first event of a burst schedules one callback that hands the
loop every event queued by then, and the events that follow it in the same burst ride along.

A :class:`Generation` is one submitted request as a route sees it: its events in order, its
deadline held by one timer (not a timeout per event), and, for answers that are not streamed,
a watcher that notices a client that went away.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field, replace

from fastapi import Request

from service.engine.core import Engine
from service.engine.sequence import Event, FinalEvent, FinishReason, Sequence

DISCONNECT_POLL_S = 0.25  # how often a request not streamed checks that its client is still there
_SINKS: dict[asyncio.AbstractEventLoop, EventSink] = {}


class EventSink:
    """Events from the engine thread to queues of one event loop, one wake-up per burst.

    :meth:`put` may be called from any thread; the queues are filled on the loop's thread, in
    the order the events were put.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: collections.deque[tuple[asyncio.Queue, Event]] = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> EventSink:
        """The sink of ``loop`` (made on first use; call on the loop's thread)."""
        if loop not in _SINKS:
            _SINKS[loop] = cls(loop)
        return _SINKS[loop]

    def put(self, queue: asyncio.Queue, event: Event) -> None:
        """Queue ``event`` for ``queue`` (any thread)."""
        self._pending.append((queue, event))
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed (shutdown): nobody is listening any more
            pass

    def _drain(self) -> None:
        with self._lock:
            self._scheduled = False  # an event put from now on schedules another drain
        while self._pending:
            queue, event = self._pending.popleft()
            queue.put_nowait(event)


_TIMED_OUT = object()  # put by the deadline timer
_GONE = object()  # put by the disconnect watcher


@dataclass
class Generation:
    """One submitted request: its engine, its sequence, the queue its events arrive on, its
    time limit in seconds and its deadline (a ``time.perf_counter()`` time, ``seq.deadline``).
    Call :meth:`arm` on the event loop once it is submitted."""

    engine: Engine
    seq: Sequence
    events: asyncio.Queue
    timeout_s: float
    deadline: float
    done: bool = False  # its final event was returned
    _timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    _watcher: asyncio.Task | None = field(default=None, repr=False)

    def arm(self) -> None:
        """Start the deadline timer: at the deadline the request is cancelled as timed out and
        a ``timeout`` final event follows whatever arrived before it (the engine may be busy
        with a compile or a long prefill; its own final event is then never read)."""
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(0.0, self.deadline - time.perf_counter()), self._expire)

    async def next(self) -> Event:
        """The next event; a final event's ``error`` always says why a ``timeout`` or
        ``cancelled`` request ended."""
        while True:
            event = self._resolve(await self.events.get())
            if event is not None:
                return event

    def ready(self) -> list[Event]:
        """The events already queued, without waiting (up to and including a final one)."""
        out: list[Event] = []
        while not self.done and not self.events.empty():
            event = self._resolve(self.events.get_nowait())
            if event is not None:
                out.append(event)
        return out

    async def next_or_gone(self, request: Request) -> Event | None:
        """:meth:`next`, or None once the client disconnected (noticed within
        ``DISCONNECT_POLL_S`` by a watcher task); the request is then cancelled."""
        if self._watcher is None and not self.done:
            self._watcher = asyncio.create_task(self._watch(request))
        while True:
            item = await self.events.get()
            if item is _GONE:
                return None
            event = self._resolve(item)
            if event is not None:
                return event

    def unwatch(self) -> None:
        """Stop the disconnect watcher (a streamed answer: Starlette notices the disconnect)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def cancel(self) -> None:
        """The client went away: end the request at the engine's next step."""
        self.engine.cancel(self.seq)
        self._close()

    def _resolve(self, item) -> Event | None:
        """The event ``item`` stands for (None: nothing to return, e.g. a marker after the end)."""
        if self.done or item is _GONE:
            return None
        if item is _TIMED_OUT:
            self.engine.cancel(self.seq, FinishReason.TIMEOUT)
            item = replace(self.seq.final_event(), finish_reason=FinishReason.TIMEOUT)
        if isinstance(item, FinalEvent):
            self._close()
            return self._explained(item)
        return item

    def _expire(self) -> None:
        if not self.done:
            self.events.put_nowait(_TIMED_OUT)

    async def _watch(self, request: Request) -> None:
        while not self.done:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if not self.done and await request.is_disconnected():
                self.engine.cancel(self.seq)
                self.events.put_nowait(_GONE)
                return

    def _close(self) -> None:
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()

    def _explained(self, event: FinalEvent) -> FinalEvent:
        if event.error is not None:
            return event
        if event.finish_reason is FinishReason.TIMEOUT:
            return replace(event, error=f"request timed out after {self.timeout_s:g} s (request_timeout_s)")
        if event.finish_reason is FinishReason.CANCELLED:
            return replace(event, error="request cancelled")
        return event
