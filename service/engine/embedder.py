"""The embedding engine: one thread that embeds the inputs of concurrent requests together.

Requests hand in token-id lists (:meth:`Embedder.submit`) and get a future of their
embeddings. Each step takes up to the largest batch bucket of waiting inputs, oldest first,
pads them to a (batch, length) bucket and runs the encoder compiled for that bucket (the
compile cache's key ``embed``, ``b{B}x{T}``); a burst of requests is served in fewer steps
than requests. Warm-up compiles the buckets :meth:`Embedder.start` is given before ready.

Each encoder call (warm-up's and each step's) is timed on :attr:`Embedder.clock`, with the
seconds a step is expected to take (its padded tokens at the slowest rate a served step has run
at so far): the watchdog fails an embedder whose step outlasts that many times over
(:class:`service.process.watchdog.EngineWatchdog`), as it fails a pipeline group's hung wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from models.sentence import EmbeddingModel
from service.engine.compile_cache import CompileCache, StepKey, StepSpec
from service.engine.stall import StallClock
from service.engine.threads import on_own_thread
from service.metrics import EmbeddingStat, Metrics, StepStat

log = logging.getLogger("stepserve.embed")


class EmbedderStopped(RuntimeError):
    """The embedder stopped before the request was embedded (shutdown or a failed step)."""


class EmbedderFailed(RuntimeError):
    """The embedder's thread died or is stuck in a step (:meth:`Embedder.fail`, called by the
    watchdog): the request will never be embedded (HTTP 500); the message names the failure."""


@dataclass
class _Job:
    """One request: its inputs, the embeddings filled in as steps finish, and its future."""

    rows: list[list[int]]
    future: Future[np.ndarray]
    out: np.ndarray  # [N, D] float32
    next_row: int = 0  # rows before this one are in a step or done
    done: int = 0
    arrival: float = field(default_factory=time.perf_counter)


def pick(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket holding ``n`` (ascending ``buckets``; ``n`` at most the last)."""
    return next(b for b in buckets if b >= n)


def length_buckets(prompt_buckets: list[int], max_tokens: int) -> tuple[int, ...]:
    """Input-length buckets: the model's prompt buckets up to ``max_tokens``, and
    ``max_tokens`` itself as the last, so every admissible input has one."""
    return (*(t for t in prompt_buckets if t < max_tokens), max_tokens)


class Embedder:
    """Embeds token-id lists for one :class:`EmbeddingModel` on its own thread.

    Args:
        model: the encoder.
        batch_buckets: batch sizes compiled for (ascending); a step holds at most the last.
        lengths: input lengths compiled for (ascending, :func:`length_buckets`); the last is the
            longest input accepted.
        cache: the compile cache (its lookups and compiles are recorded as the chat steps').
        metrics: where requests and steps are recorded.

    Attributes:
        clock: the encoder call running now and the seconds it is expected to take (the
            watchdog's view); a step's expectation is its padded tokens (batch x length) times
            :attr:`seconds_per_token`, unknown (None) during warm-up and before the first step.
        seconds_per_token: the slowest a served step has run so far, in seconds per padded
            token (None before the first).
    """

    def __init__(
        self,
        model: EmbeddingModel,
        batch_buckets: tuple[int, ...],
        lengths: tuple[int, ...],
        cache: CompileCache,
        metrics: Metrics,
    ):
        self.model, self.batch_buckets, self.lengths = model, batch_buckets, lengths
        self.cache, self.metrics = cache, metrics
        self.ready = threading.Event()
        self.not_ready_reason = "warming up"
        self.warmup_seconds: float | None = None
        self.warmup_buckets = 0
        self._jobs: deque[_Job] = deque()
        self._in_step: list[_Job] = []  # the requests of the step running now
        self._wake = threading.Condition()
        self._stopping = False
        self._failed = False
        self._thread: threading.Thread | None = None
        self.clock = StallClock()
        self.seconds_per_token: float | None = None
        metrics.init_embedding(model.name)

    @property
    def max_tokens(self) -> int:
        """The longest input accepted, in tokens."""
        return self.lengths[-1]

    def submit(self, rows: list[list[int]]) -> Future[np.ndarray]:
        """Queue one request's inputs (each 1..max_tokens ids, below the vocabulary size).

        Returns:
            A future of their embeddings, [len(rows), D] float32, in order; it fails with
            :class:`EmbedderStopped` when the embedder stops first.
        """
        future: Future[np.ndarray] = Future()
        job = _Job(rows, future, np.empty((len(rows), self.model.dimensions), np.float32))
        with self._wake:
            if self._stopping:
                future.set_exception(EmbedderStopped("the embedding model is shutting down"))
                return future
            self._jobs.append(job)
            self._wake.notify()
        self.metrics.record_embedding(EmbeddingStat(self.model.name, len(rows), sum(map(len, rows))))
        return future

    def start(self, warmup: list[tuple[int, int]], progress: Callable[[str], None] | None = None) -> None:
        """Start the thread: compile each (batch, length) of ``warmup``, seal the cache (a cold
        bucket then runs eagerly), set :attr:`ready`, then serve."""
        self._thread = threading.Thread(target=self._run, args=(warmup, progress), name=f"embed-{self.model.name}")
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step (waiting up to ``timeout`` seconds for it; not
        at all once :meth:`fail` was called: it may be stuck); requests still queued fail."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(0 if self._failed else timeout)
        self._fail_all(EmbedderStopped("the embedding model is shutting down"))

    def load(self) -> list[int]:
        """The length in tokens of every input queued or in the running step and not yet
        embedded (memory admission's view, :func:`service.process.memory.embedder_load_bytes`)."""
        with self._wake:
            jobs = {id(job): job for job in (*self._in_step, *self._jobs)}.values()
            return [len(row) for job in jobs for row in job.rows[job.done :]]

    @property
    def alive(self) -> bool:
        """The embedding thread is running (False before :meth:`start` and once it ended)."""
        return self._thread is not None and self._thread.is_alive()

    def fail(self, message: str, reason: str = "embedding thread died") -> None:
        """The embedding thread is gone, or stuck in a step: mark the model not ready
        (``reason``), refuse new work and end every request it held, queued or in the step that
        was running, with :class:`EmbedderFailed` (``message``; HTTP 500). Called by the
        watchdog; should a stuck step finish after all, its results are dropped and the thread
        ends."""
        self.not_ready_reason = reason
        self.ready.clear()
        with self._wake:
            self._stopping = self._failed = True
            self._jobs.extend(self._in_step)
            self._in_step = []
        self._fail_all(EmbedderFailed(message))

    def compile_choices(self) -> dict[str, str]:
        """Per bucket label: "compiled" or "eager"."""
        return {k.bucket: "compiled" if c else "eager" for k, c in self.cache.choices().items()}

    def _fn(self, batch: int, length: int):
        key = StepKey(self.model.name, "embed", batch, length, str(self.model.dtype).removeprefix("mlx.core."))
        return self.cache.get(key, StepSpec(self.model.embed))

    def _run(self, warmup: list[tuple[int, int]], progress: Callable[[str], None] | None) -> None:
        start = time.perf_counter()

        def warm_up() -> None:
            for batch, length in warmup:
                if progress is not None:
                    progress(f"{self.model.name}: compiling embed b{batch}x{length}")
                ones = mx.ones((batch, length), mx.int32)
                with self.clock.running():  # a compile: its time says nothing of a step's
                    mx.eval(self._fn(batch, length)(ones, ones))

        try:
            on_own_thread(warm_up, f"stepserve-warmup-{self.model.name}")  # its allocations off this thread's arena
        except Exception as exc:  # noqa: BLE001 - reported by /readyz, the thread ends
            log.exception("embedding warm-up of %s failed", self.model.name)
            self.not_ready_reason = f"warm-up failed: {type(exc).__name__}"
            return
        self.cache.seal()
        self.warmup_seconds, self.warmup_buckets = time.perf_counter() - start, len(warmup)
        self.not_ready_reason = ""
        self.ready.set()
        log.info("embedding model %s ready: %d buckets in %.1f s", self.model.name, len(warmup), self.warmup_seconds)
        while True:
            with self._wake:
                while not self._jobs and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - every waiting request learns of it
                log.exception("embedding step of %s failed", self.model.name)
                self._fail_all(exc)

    def _take(self) -> list[tuple[_Job, int]]:
        """Up to the largest batch bucket of waiting rows, oldest request first: (job, row index)."""
        taken: list[tuple[_Job, int]] = []
        with self._wake:
            for job in self._jobs:
                while job.next_row < len(job.rows) and len(taken) < self.batch_buckets[-1]:
                    taken.append((job, job.next_row))
                    job.next_row += 1
            while self._jobs and self._jobs[0].next_row == len(self._jobs[0].rows):
                self._jobs.popleft()  # every row in a step: the step finishes it
        return taken

    def step(self) -> int:
        """Embed one batch of waiting rows; returns how many (0: none waited)."""
        taken = self._take()
        if not taken:
            return 0
        self._in_step = list({id(job): job for job, _ in taken}.values())
        start = time.perf_counter()
        longest = max(len(job.rows[i]) for job, i in taken)
        batch, length = pick(self.batch_buckets, len(taken)), pick(self.lengths, longest)
        ids = np.zeros((batch, length), np.int32)  # ids, mask: [B, T]
        mask = np.zeros((batch, length), np.int32)
        mask[len(taken) :, 0] = 1  # padding rows attend to one token: no empty softmax
        for r, (job, i) in enumerate(taken):
            ids[r, : len(job.rows[i])] = job.rows[i]
            mask[r, : len(job.rows[i])] = 1
        padded = batch * length
        expected = None if self.seconds_per_token is None else padded * self.seconds_per_token
        try:
            with self.clock.running(expected):
                called = time.perf_counter()
                out = np.array(self._fn(batch, length)(mx.array(ids), mx.array(mask)))  # [B, D]
                rate = (time.perf_counter() - called) / padded
        except Exception as exc:
            for job, _ in taken:
                if not job.future.done():
                    job.future.set_exception(exc)
            self._in_step = []
            raise
        self.seconds_per_token = max(rate, self.seconds_per_token or 0.0)
        for r, (job, i) in enumerate(taken):
            job.out[i] = out[r]
            job.done += 1
            if job.done == len(job.rows) and not job.future.done():
                job.future.set_result(job.out)
        self._in_step = []
        self.metrics.record_step(
            StepStat(self.model.name, "embed", f"b{batch}x{length}", len(taken), batch, time.perf_counter() - start)
        )
        self.metrics.embedding_steps.labels(self.model.name).inc()
        return len(taken)

    def _fail_all(self, exc: BaseException) -> None:
        with self._wake:
            jobs, self._jobs = list(self._jobs), deque()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(exc)
