"""The engine: one thread that owns MLX and runs schedule -> step -> update, forever.

Handlers never touch MLX: they :meth:`Engine.submit` a :class:`Sequence` and await the
events it emits. Between decode steps the scheduler admits waiting requests, which are
prefilled (batched by prompt bucket) and merged into free slots of the running batch;
finished, cancelled and timed-out rows free their slot before the next step.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from models.loader import LoadedModel
from service.buckets import BucketTable
from service.compile_cache import CompileCache
from service.metrics import Metrics, RequestStat, StepStat
from service.runner import ModelRunner
from service.scheduler import Scheduler
from service.sequence import FinishReason, Sequence

log = logging.getLogger("stepserve.engine")


@dataclass(frozen=True)
class WarmupSpec:
    """What to compile before serving: buckets of requests of up to ``prompt_tokens`` prompt
    tokens, up to ``batch`` at a time, growing to ``batched_positions`` positions when
    batched (a lone request: every capacity bucket)."""

    prompt_tokens: int = 512
    batch: int = 1
    batched_positions: int | None = None
IDLE_WAIT_S = 0.05
SHUTDOWN = "server shutting down"


class Engine:
    """Serves one model with continuous batching over compiled buckets.

    Args:
        model: the loaded model.
        buckets: bucket table; its largest batch bucket caps the running batch.
        cache: the compile cache.
        metrics: where stats go.
        max_waiting: queued requests beyond the running batch (more get 429).
        max_admit: requests prefilled per step at most.
        max_running: running sequences at most (default and ceiling: the largest batch bucket).
    """

    def __init__(self, model: LoadedModel, buckets: BucketTable, cache: CompileCache, metrics: Metrics,
                 max_waiting: int = 256, max_admit: int = 4, max_running: int | None = None):
        self.model, self.buckets, self.metrics = model, buckets, metrics
        self.runner = ModelRunner(model, buckets, cache)
        self.scheduler = Scheduler(min(max_running or buckets.batch[-1], buckets.batch[-1]), max_waiting, max_admit)
        self.capacity_limit = buckets.capacity[-1]
        self._slots: list[Sequence | None] = []
        self._keys: dict[str, mx.array] = {}
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.not_ready_reason = "warming up"
        self.warmup_seconds: float | None = None
        self.warmup_buckets = 0
        metrics.running.labels(model.name).set_function(lambda: self.scheduler.num_running)
        metrics.waiting.labels(model.name).set_function(lambda: self.scheduler.num_waiting)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, warmup: WarmupSpec, progress: Callable[[int, str], None] | None = None) -> None:
        """Start the engine thread; it warms up first, then sets :attr:`ready`."""
        self._thread = threading.Thread(target=self._main, args=(warmup, progress),
                                        name=f"stepserve-engine-{self.model.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step; whatever still runs or waits ends as cancelled."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, seq: Sequence) -> None:
        """Queue a request (thread-safe). Raises QueueFullError or DrainingError."""
        self.scheduler.add(seq)

    def cancel(self, seq: Sequence) -> None:
        """The client went away: free the request's slot before the next decode step."""
        self.scheduler.cancel(seq)

    def abort_all(self) -> None:
        """End every running and queued request as cancelled ("server shutting down") at the
        next step (thread-safe; used when the shutdown grace period is over)."""
        self._abort.set()
        self.scheduler.drain()

    def compile_choices(self) -> dict[str, str]:
        """``{"decode b1x256": "compiled" | "eager", ...}`` for every step function built so far."""
        return {f"{k.phase} {k.bucket}": "compiled" if c else "eager" for k, c in self.runner.compiled.choices().items()}

    @property
    def idle(self) -> bool:
        return self.scheduler.num_running == 0 and self.scheduler.num_waiting == 0

    # -- the thread ----------------------------------------------------------------------

    def _main(self, warmup: WarmupSpec, progress) -> None:
        try:
            self._warmup(warmup, progress)
        except Exception as exc:  # a model that cannot run is not ready, and says why
            log.exception("warm-up failed")
            self.not_ready_reason = f"warm-up failed: {type(exc).__name__}"
            return
        self.not_ready_reason = ""
        self.ready.set()
        while not self._stop.is_set():
            try:
                if self._abort.is_set():
                    self._abort_everything()
                self._iteration()
            except Exception as exc:
                log.exception("engine step failed")
                self._fail_running(f"internal error in the engine step: {type(exc).__name__}")
        self._abort_everything()

    def _abort_everything(self) -> None:
        for seq in self.scheduler.abort_all(FinishReason.CANCELLED):
            self._release(seq)
            self._finish(seq, error=SHUTDOWN)
        self._slots = []
        self.runner.reset()

    def _warmup(self, warmup: WarmupSpec, progress) -> None:
        start = time.perf_counter()
        plan = self.runner.warmup_plan(warmup.prompt_tokens, warmup.batch, self.scheduler.max_admit, warmup.batched_positions)
        for i, (phase, b, size) in enumerate(plan):
            t0 = time.perf_counter()
            compiled = self.runner.warm(phase, b, size)
            label = f"{phase} b{b}x{size}" if size else (f"{phase} b{b}" if b else phase)
            log.info("warm-up %d/%d: %s ready in %.2f s, runs %s", i + 1, len(plan), label, time.perf_counter() - t0,
                     "compiled" if compiled else "eager")
            if progress:
                progress(len(plan), label)
        self.warmup_seconds, self.warmup_buckets = time.perf_counter() - start, len(plan)
        for key, compiled in self.runner.compiled.choices().items():
            self.metrics.compiled_step.labels(key.model, key.phase, key.bucket).set(int(compiled))
        log.info("warm-up done: %d buckets in %.1f s", len(plan), self.warmup_seconds)

    def _iteration(self) -> None:
        out = self.scheduler.schedule()
        for seq, reason in out.aborted:
            self._release(seq)
            seq.finish_reason = reason
            self._finish(seq)
        if out.admitted:
            self._prefill(out.admitted)
        if any(s is not None for s in self._slots):
            self._decode()
        elif not out.admitted:
            self.scheduler.wait_for_work(IDLE_WAIT_S)

    def _prefill(self, admitted: list[Sequence]) -> None:
        """Prefill new requests, grouped by prompt bucket, and merge them into free slots."""
        groups: dict[int, list[Sequence]] = {}
        for seq in admitted:
            seq.started = time.perf_counter()
            groups.setdefault(self.buckets.prompt_for(len(seq.prompt_ids)), []).append(seq)
        for group in groups.values():
            try:
                self._prefill_group(group)
            except Exception as exc:
                log.exception("prefill failed")
                for seq in group:
                    self._release(seq)
                    self._finish(seq, error=f"prefill failed: {type(exc).__name__}")

    def _prefill_group(self, group: list[Sequence]) -> None:
        start = time.perf_counter()
        logits, prompt_kv = self.runner.prefill([s.prompt_ids for s in group])
        rows: list[Sequence | None] = group + [None] * (logits.shape[0] - len(group))
        keys = [mx.random.key(s.params.seed) if s and s.params.seed is not None else None for s in rows]
        tokens, keys = self.runner.select(logits, rows, keys)
        self._record_step("prefill", prompt_kv.batch, prompt_kv.capacity, len(group), start)
        joining = []
        for i, (seq, token) in enumerate(zip(group, tokens.tolist(), strict=False)):
            seq.position = len(seq.prompt_ids)
            seq.append(token, self.model.tokenizer.stop_token_ids, self.capacity_limit)
            if seq.finish_reason is not None:
                self._finish(seq)
            else:
                joining.append((i, seq))
                if keys[i] is not None:
                    self._keys[seq.request_id] = keys[i]
        if not joining:
            return
        live = [s for s in self._slots if s is not None]
        self._fit(live, [seq for _, seq in joining])
        free = iter(i for i, s in enumerate(self._slots) if s is None)
        for row, seq in joining:
            slot = next(free)
            self.runner.insert(seq, slot, prompt_kv, row)
            self._slots[slot] = seq

    def _decode(self) -> None:
        """One decode step for the running batch, then per-row stop checks."""
        start = time.perf_counter()
        slots = self._slots
        logits = self.runner.decode(slots)
        keys = [self._keys.get(s.request_id) if s else None for s in slots]
        tokens, next_keys = self.runner.select(logits, slots, keys)
        token_list = tokens.tolist()
        live = sum(s is not None for s in slots)
        self._record_step("decode", self.runner.kv.batch, self.runner.kv.capacity, live, start)
        stop_ids = self.model.tokenizer.stop_token_ids
        for i, (seq, token) in enumerate(zip(slots, token_list, strict=True)):
            if seq is None:
                continue
            seq.position += 1
            if next_keys[i] is not None:
                self._keys[seq.request_id] = next_keys[i]
            seq.append(token, stop_ids, self.capacity_limit)
            if seq.finish_reason is not None:
                self._release(seq)
                self._finish(seq)
        live_seqs = [s for s in self._slots if s is not None]
        if live_seqs:
            self._fit(live_seqs)
        else:
            self._slots = []
            self.runner.reset()

    # -- slots and bookkeeping -----------------------------------------------------------

    def _fit(self, live: list[Sequence], joining: list[Sequence] = ()) -> None:
        """Re-bucket the decode cache and rebuild the slot table from each row's slot."""
        moves = self.runner.fit(live, joining)
        for kind in moves:
            self.metrics.bucket_moves.labels(self.model.name, kind).inc()
        self._slots = [None] * self.runner.kv.batch
        for seq in live:
            self._slots[seq.slot] = seq

    def _release(self, seq: Sequence) -> None:
        """Free the request's slot (if it has one) and its scheduler entry."""
        if 0 <= seq.slot < len(self._slots) and self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None
        seq.slot = -1
        self.scheduler.finish(seq)

    def _record_step(self, phase: str, batch: int, size: int, rows: int, start: float) -> None:
        self.metrics.record_step(StepStat(self.model.name, phase, f"b{batch}x{size}", rows, batch, time.perf_counter() - start))

    def _finish(self, seq: Sequence, error: str | None = None) -> None:
        self.scheduler.finish(seq)
        self._keys.pop(seq.request_id, None)
        if error is not None:
            seq.finish_reason = seq.finish_reason if seq.finish_reason is FinishReason.CANCELLED else FinishReason.ERROR
        final = seq.final_event(error)
        self.metrics.record_request(RequestStat(self.model.name, final.finish_reason.value, final.prompt_tokens,
                                                final.completion_tokens, final.total_s, final.ttft_s, tuple(seq.inter_token_s),
                                                shutdown=error == SHUTDOWN))
        seq.emit(final)

    def _fail_running(self, message: str) -> None:
        for seq in [s for s in self._slots if s is not None]:
            self._release(seq)
            self._finish(seq, error=message)
        self._slots = []
        self.runner.reset()
