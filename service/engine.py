"""The engine: one thread that owns MLX and runs admit -> decode step -> update, forever.

Handlers never touch MLX: they :meth:`Engine.submit` a :class:`Sequence` and await the
events it emits. New requests are prefilled and merged into free slots of the running
batch between decode steps; finished rows free their slot at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import mlx.core as mx

from models.loader import LoadedModel
from service.buckets import BucketTable
from service.compile_cache import CompileCache
from service.metrics import Metrics, RequestStat
from service.runner import ModelRunner
from service.sequence import FinishReason, Sequence

log = logging.getLogger("stepserve.engine")


class Engine:
    """Serves one model. ``max_running`` caps the running batch (the largest batch bucket)."""

    def __init__(self, model: LoadedModel, buckets: BucketTable, cache: CompileCache, metrics: Metrics):
        self.model, self.buckets, self.metrics = model, buckets, metrics
        self.runner = ModelRunner(model, buckets, cache)
        self.max_running = buckets.batch[-1]
        self.capacity_limit = buckets.capacity[-1]
        self._waiting: queue.Queue[Sequence] = queue.Queue()
        self._slots: list[Sequence | None] = []
        self._keys: dict[str, mx.array] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.not_ready_reason = "warming up"
        self.warmup_seconds: float | None = None
        metrics.running.set_function(lambda: self.running)
        metrics.waiting.set_function(self._waiting.qsize)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, warmup_prompt_tokens: int, progress: Callable[[int, str], None] | None = None) -> None:
        """Start the engine thread; it warms up first, then sets :attr:`ready`."""
        self._thread = threading.Thread(target=self._main, args=(warmup_prompt_tokens, progress), name="stepserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after the current step and fail what is still queued or running."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, seq: Sequence) -> None:
        """Queue a request (thread-safe). Its events arrive through ``seq.emit``."""
        self._waiting.put(seq)

    @property
    def running(self) -> int:
        return sum(s is not None for s in self._slots)

    # -- the thread ----------------------------------------------------------------------

    def _main(self, warmup_prompt_tokens: int, progress) -> None:
        try:
            self._warmup(warmup_prompt_tokens, progress)
        except Exception as exc:  # a model that cannot run is not ready, and says why
            log.exception("warm-up failed")
            self.not_ready_reason = f"warm-up failed: {exc}"
            return
        self.not_ready_reason = ""
        self.ready.set()
        while not self._stop.is_set():
            try:
                self._admit(block=self.running == 0)
                if self.running:
                    self._step()
            except Exception as exc:
                log.exception("engine step failed")
                self._fail_running(f"internal error in the engine step: {type(exc).__name__}")
        self._fail_running("server shutting down")

    def _warmup(self, prompt_tokens: int, progress) -> None:
        start = time.perf_counter()
        plan = self.runner.warmup_plan(prompt_tokens)
        for i, (phase, batch, size) in enumerate(plan):
            t0 = time.perf_counter()
            self.runner.warm(phase, batch, size)
            label = f"{phase} b{batch}x{size}" if batch else phase
            log.info("warm-up %d/%d: %s compiled in %.2f s", i + 1, len(plan), label, time.perf_counter() - t0)
            if progress:
                progress(len(plan), label)
        self.warmup_seconds = time.perf_counter() - start
        log.info("warm-up done: %d buckets in %.1f s", len(plan), self.warmup_seconds)

    def _admit(self, block: bool) -> None:
        """Prefill waiting requests into free slots (one prefill per request, FCFS)."""
        while self.running < self.max_running:
            try:
                seq = self._waiting.get(timeout=0.05) if block else self._waiting.get_nowait()
            except queue.Empty:
                return
            block = False
            try:
                self._prefill(seq)
            except Exception as exc:
                log.exception("prefill failed for %s", seq.request_id)
                self._finish(seq, error=f"prefill failed: {type(exc).__name__}")

    def _prefill(self, seq: Sequence) -> None:
        seq.started = time.perf_counter()
        logits, prompt_kv = self.runner.prefill([seq.prompt_ids])
        seq.position = len(seq.prompt_ids)
        key = mx.random.key(seq.params.seed) if seq.params.seed is not None else None
        tokens, (key,) = self.runner.select(logits, [seq], [key])
        token = tokens.tolist()[0]
        seq.append(token, self.model.tokenizer.stop_token_ids, self.capacity_limit)
        if seq.finish_reason is not None:
            self._finish(seq)
            return
        live = [s for s in self._slots if s is not None]
        self.runner.fit(live, extra_rows=1)
        self._slots = [None] * self.runner.kv.batch
        for s in live:
            self._slots[s.slot] = s
        slot = self._slots.index(None)
        self.runner.insert(seq, slot, prompt_kv, 0)
        self._slots[slot] = seq
        if key is not None:
            self._keys[seq.request_id] = key

    def _step(self) -> None:
        """One decode step for the running batch, then per-row stop checks."""
        slots = self._slots
        logits = self.runner.decode(slots)
        keys = [self._keys.get(s.request_id) if s else None for s in slots]
        tokens, next_keys = self.runner.select(logits, slots, keys)
        stop_ids = self.model.tokenizer.stop_token_ids
        for i, (seq, token) in enumerate(zip(slots, tokens.tolist(), strict=True)):
            if seq is None:
                continue
            seq.position += 1
            if next_keys[i] is not None:
                self._keys[seq.request_id] = next_keys[i]
            seq.append(token, stop_ids, self.capacity_limit)
            if seq.finish_reason is not None:
                slots[i] = None
                self._finish(seq)
        self._rebucket()

    def _rebucket(self) -> None:
        live = [s for s in self._slots if s is not None]
        if not live:
            self._slots = []
            self.runner.reset()
            return
        self.runner.fit(live)
        self._slots = [None] * self.runner.kv.batch
        for s in live:
            self._slots[s.slot] = s

    def _finish(self, seq: Sequence, error: str | None = None) -> None:
        self._keys.pop(seq.request_id, None)
        if error is not None:
            seq.finish_reason = FinishReason.ERROR
        final = seq.final_event(error)
        self.metrics.record_request(
            RequestStat(self.model.name, "error" if error else "ok", final.prompt_tokens, final.completion_tokens,
                        final.total_s, final.ttft_s, tuple(seq.inter_token_s))
        )
        seq.emit(final)

    def _fail_running(self, message: str) -> None:
        for i, seq in enumerate(self._slots):
            if seq is not None:
                self._slots[i] = None
                self._finish(seq, error=message)
        self._slots = []
        self.runner.reset()
        while True:
            try:
                seq = self._waiting.get_nowait()
            except queue.Empty:
                break
            self._finish(seq, error=message)
