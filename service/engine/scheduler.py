"""The scheduler: decides, before each engine step, which requests join, leave or wait, and
which prompts advance by one prefill chunk.

Plain Python: no MLX and no asyncio, so it can be tested alone. It is FCFS: requests are
admitted in arrival order whenever the running batch has room, so none starves. Each step
processes at most ``max_batched_tokens`` tokens — one per decoding row, and prompt chunks of
at most ``chunk_tokens`` — so a long prompt costs the running streams at most one chunk's
time per step (vLLM's ``max_num_batched_tokens`` and chunked prefill). The engine calls
:meth:`Scheduler.schedule` between decode steps; HTTP handlers call :meth:`add` and
:meth:`cancel` from the event loop's thread, hence the lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from service.engine.sequence import FinishReason, Sequence


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; the client should retry later (HTTP 429)."""


class DrainingError(RuntimeError):
    """The server is shutting down and admits nothing new (HTTP 503)."""


@dataclass
class SchedulerOutput:
    """What the engine does in the next step.

    Attributes:
        admitted: waiting requests that join the running set this step, in arrival order
            (each is also in ``prefill``).
        prefill: running requests whose prompt advances by one chunk this step (at most
            ``chunk_tokens`` tokens each), in arrival order; a request whose last chunk this is
            gets its first token and a decode slot.
        aborted: requests to end now, with the reason (cancelled, timeout, shutdown).
    """

    admitted: list[Sequence] = field(default_factory=list)
    prefill: list[Sequence] = field(default_factory=list)
    aborted: list[tuple[Sequence, FinishReason]] = field(default_factory=list)


class Scheduler:
    """FCFS admission into a running batch of at most ``max_running`` sequences, under a
    per-step token budget.

    Args:
        max_running: running sequences at most (prefilling or decoding).
        max_waiting: queued requests beyond the running batch; more are refused.
        chunk_tokens: prompt tokens one request prefills per step at most.
        max_batched_tokens: tokens one step processes at most: a token per decoding row plus
            the prompt chunks. A step always makes progress: its first chunk is scheduled even
            when it alone exceeds the budget.
        cached_tokens: prompt tokens ids -> how many the prefix cache holds (called on the
            engine thread, which schedules; default none).
        fits: whether the request at the head of the queue may be admitted now (a paged KV
            pool's blocks, or a shared prefix another request is still prefilling,
            :meth:`service.engine.core.Engine._fits`; default: always). The head waits until
            it does, and those behind it too (first come, first served).
    """

    def __init__(
        self,
        max_running: int,
        max_waiting: int,
        chunk_tokens: int = 512,
        max_batched_tokens: int = 2048,
        cached_tokens: Callable[[list[int]], int] = lambda ids: 0,
        fits: Callable[[Sequence], bool] = lambda seq: True,
    ):
        self.max_running, self.max_waiting = max_running, max_waiting
        self.fits = fits
        self.chunk_tokens, self.max_batched_tokens = chunk_tokens, max_batched_tokens
        self.cached_tokens = cached_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.draining = False
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a request. Raises QueueFullError or DrainingError."""
        with self._lock:
            if self.draining:
                raise DrainingError("server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFullError(f"waiting queue is full ({self.max_waiting} requests)")
            self.waiting.append(seq)
            self._wake.notify()

    def cancel(self, seq: Sequence, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """End a request at the next schedule with ``reason``: CANCELLED (the client went
        away) or TIMEOUT (its deadline passed, seen by the HTTP side). The first reason wins."""
        with self._lock:
            if seq.cancel_reason is None:
                seq.cancel_reason = reason
            self._wake.notify()

    def drain(self) -> None:
        """Refuse new requests from now on; queued and running ones go on."""
        with self._lock:
            self.draining = True
            self._wake.notify()

    def wait_for_work(self, timeout: float) -> None:
        """Block the engine thread until a request arrives or ``timeout`` seconds pass."""
        with self._lock:
            if not self.waiting and not self.running:
                self._wake.wait(timeout)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Pick this step's admissions and aborts; admitted requests count as running."""
        now = time.perf_counter() if now is None else now
        out = SchedulerOutput()
        with self._lock:
            for queue in (self.waiting, self.running):
                for seq in list(queue):
                    reason = _abort_reason(seq, now)
                    if reason is not None:
                        queue.remove(seq)
                        out.aborted.append((seq, reason))
            budget = self.max_batched_tokens - sum(s.prompt_done for s in self.running)
            for seq in self.running:  # prompts already being prefilled go first
                if not seq.prompt_done:
                    budget = self._take_chunk(seq, budget, out)
            while self.waiting and len(self.running) < self.max_running:
                if self._chunk(self.waiting[0]) > budget and out.prefill or not self.fits(self.waiting[0]):
                    break
                seq = self.waiting.popleft()
                self.running.append(seq)
                out.admitted.append(seq)
                budget = self._take_chunk(seq, budget, out)
        return out

    def _chunk(self, seq: Sequence) -> int:
        """Tokens ``seq``'s next prefill chunk takes at most (a waiting request's prompt
        counts without what the prefix cache holds of it)."""
        done = seq.num_computed if seq.started is not None else self.cached_tokens(seq.prefill_ids)
        return min(self.chunk_tokens, len(seq.prefill_ids) - done)

    def _take_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        tokens = self._chunk(seq)
        if tokens <= budget or not out.prefill:
            out.prefill.append(seq)
            budget -= tokens
        return budget

    def preempt(self, seq: Sequence) -> None:
        """Put a running request back at the head of the queue (its KV blocks were taken back:
        vLLM v1's preemption by recomputation); it is admitted again before any other."""
        with self._lock:
            if seq in self.running:
                self.running.remove(seq)
            self.waiting.appendleft(seq)

    def load(self) -> list[tuple[int, int]]:
        """(prompt tokens, max_tokens) of every running and waiting request, read under the lock."""
        with self._lock:
            return [(len(s.prompt_ids), s.params.max_tokens) for s in (*self.running, *self.waiting)]

    def finish(self, seq: Sequence) -> None:
        """A running request ended (stop, length or error); its slot is free."""
        with self._lock:
            if seq in self.running:
                self.running.remove(seq)

    def abort_all(self, reason: FinishReason) -> list[Sequence]:
        """Remove every waiting and running request (shutdown); returns them."""
        with self._lock:
            gone = list(self.waiting) + self.running
            self.waiting.clear()
            self.running = []
        for seq in gone:
            seq.finish_reason = reason
        return gone


def _abort_reason(seq: Sequence, now: float) -> FinishReason | None:
    if seq.cancel_reason is not None:
        return seq.cancel_reason
    if seq.deadline is not None and now >= seq.deadline:
        return FinishReason.TIMEOUT
    return None
