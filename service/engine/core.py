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
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from models.loader import LoadedModel
from service.engine.buckets import BucketTable
from service.engine.compile_cache import CompileCache
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler
from service.engine.sequence import FinishReason, Sequence
from service.metrics import Metrics, RequestStat, StepStat

log = logging.getLogger("stepserve.engine")


@dataclass(frozen=True)
class WarmupSpec:
    """What to compile before serving: buckets of requests of up to ``prompt_tokens`` prompt
    tokens, up to ``batch`` at a time, growing to ``batched_positions`` positions when
    batched (a lone request: every capacity bucket)."""

    prompt_tokens: int = 512
    batch: int = 1
    batched_positions: int | None = None


@dataclass
class _DecodeStep:
    """A decode step queued on the device whose tokens have not been read back yet.

    Attributes:
        rows: the sequence in each batch row when the step was queued (None: empty slot).
        tokens: int32 [B], the step's selected tokens (lazy until read back).
        queued: ``time.perf_counter()`` when it was queued.
        bucket: (batch, capacity) bucket it ran at.
    """

    rows: list[Sequence | None]
    tokens: mx.array
    queued: float
    bucket: tuple[int, int]


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

    def __init__(
        self,
        model: LoadedModel,
        buckets: BucketTable,
        cache: CompileCache,
        metrics: Metrics,
        max_waiting: int = 256,
        max_admit: int = 4,
        max_running: int | None = None,
    ):
        self.model, self.buckets, self.metrics = model, buckets, metrics
        self.runner = ModelRunner(model, buckets, cache)
        self.scheduler = Scheduler(min(max_running or buckets.batch[-1], buckets.batch[-1]), max_waiting, max_admit)
        self.capacity_limit = buckets.capacity[-1]
        self._slots: list[Sequence | None] = []
        self._keys: dict[str, mx.array] = {}
        self._inflight: _DecodeStep | None = None
        self._last_read_back = 0.0
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.not_ready_reason = "warming up"
        self.warmup_seconds: float | None = None
        self.warmup_buckets = 0
        metrics.init_model(model.name)
        metrics.running.labels(model.name).set_function(lambda: self.scheduler.num_running)
        metrics.waiting.labels(model.name).set_function(lambda: self.scheduler.num_waiting)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, warmup: WarmupSpec, progress: Callable[[int, str], None] | None = None) -> None:
        """Start the engine thread; it warms up first, then sets :attr:`ready`."""
        self._thread = threading.Thread(
            target=self._main, args=(warmup, progress), name=f"stepserve-engine-{self.model.name}", daemon=True
        )
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
        return {
            f"{k.phase} {k.bucket}": "compiled" if c else "eager" for k, c in self.runner.compiled.choices().items()
        }

    @property
    def idle(self) -> bool:
        return self.scheduler.num_running == 0 and self.scheduler.num_waiting == 0

    @property
    def alive(self) -> bool:
        """The engine thread is running (False before :meth:`start` and once it ended)."""
        return self._thread is not None and self._thread.is_alive()

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
        self._slots, self._inflight = [], None
        self.runner.reset()

    def _warmup(self, warmup: WarmupSpec, progress) -> None:
        start = time.perf_counter()
        plan = self.runner.warmup_plan(
            warmup.prompt_tokens, warmup.batch, self.scheduler.max_admit, warmup.batched_positions
        )
        for i, (phase, b, size) in enumerate(plan):
            t0 = time.perf_counter()
            compiled = self.runner.warm(phase, b, size)
            label = f"{phase} b{b}x{size}" if size else (f"{phase} b{b}" if b else phase)
            log.info(
                "warm-up %d/%d: %s ready in %.2f s, runs %s",
                i + 1,
                len(plan),
                label,
                time.perf_counter() - t0,
                "compiled" if compiled else "eager",
            )
            if progress:
                progress(len(plan), label)
        self.warmup_seconds, self.warmup_buckets = time.perf_counter() - start, len(plan)
        for key, compiled in self.runner.compiled.choices().items():
            self.metrics.compiled_step.labels(key.model, key.phase, key.bucket).set(int(compiled))
        log.info("warm-up done: %d buckets in %.1f s", len(plan), self.warmup_seconds)

    def _iteration(self) -> None:
        """Schedule, prefill arrivals, queue decode step t+1, then read back step t.

        Step t+1 is built from step t's tokens while they are still on the device, so the
        device runs t+1 while this thread turns t's tokens into text and events: one sync
        per step, and the host's work hides behind the device's (mlx-lm's generator
        overlaps its steps with ``mx.async_eval`` the same way). A row that stops on an EOS
        token or a stop string has already been queued once more; that step's token for it
        is dropped. Rows that reach ``max_tokens`` or the capacity limit are known in advance
        and not queued.
        """
        out = self.scheduler.schedule()
        for seq, reason in out.aborted:
            self._release(seq)
            seq.finish_reason = reason
            self._finish(seq)
        if out.admitted:
            self._prefill(out.admitted)
        step = self._queue_decode() if any(s is not None for s in self._slots) else None
        previous, self._inflight = self._inflight, step
        if previous is not None:
            self._read_back(previous)
        elif step is None and not out.admitted:
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

    def _queue_decode(self) -> _DecodeStep | None:
        """Queue one decode step (``mx.async_eval``) for every row that can still grow."""
        prev = self._inflight
        pending = {id(s): i for i, s in enumerate(prev.rows) if s is not None} if prev else {}
        for seq in [s for s in self._slots if s is not None]:
            produced = len(seq.output_ids) + (id(seq) in pending)
            if produced >= seq.params.max_tokens or seq.position >= self.capacity_limit:
                self._vacate(seq)  # its last token is in flight; it finishes when that is read back
        live = [s for s in self._slots if s is not None]
        if not live:
            self._slots = []
            self.runner.reset()
            return None
        self._fit(live)
        rows = list(self._slots)  # a snapshot: slots change before this step is read back
        logits = self.runner.decode(rows, self._input_tokens(rows, prev, pending))
        keys = [self._keys.get(s.request_id) if s else None for s in rows]
        tokens, next_keys = self.runner.select(logits, rows, keys)
        for i, seq in enumerate(rows):
            if seq is not None:
                seq.position += 1
                if next_keys[i] is not None:
                    self._keys[seq.request_id] = next_keys[i]
        mx.async_eval(tokens, *(k for k in next_keys if k is not None))
        return _DecodeStep(rows, tokens, time.perf_counter(), (self.runner.kv.batch, self.runner.kv.capacity))

    @staticmethod
    def _input_tokens(rows: list[Sequence | None], prev: _DecodeStep | None, pending: dict[int, int]) -> mx.array:
        """int32 [B]: each row's newest token, taken on the device from the queued step
        ``prev`` where that step produced it, from Python otherwise (just prefilled)."""
        src = [pending.get(id(s), -1) if s is not None else -1 for s in rows]
        if (
            prev is not None
            and prev.tokens.shape[0] == len(rows)
            and all(j == i for i, j in enumerate(src) if rows[i] is not None)
        ):
            return prev.tokens  # the steady state: every row stayed in its slot
        known = mx.array(
            [s.last_token if s is not None and j < 0 else 0 for s, j in zip(rows, src, strict=True)], mx.int32
        )
        if prev is None or all(j < 0 for j in src):
            return known
        from_prev = mx.array([j >= 0 for j in src])
        return mx.where(from_prev, prev.tokens[mx.array([max(j, 0) for j in src], mx.int32)], known)

    def _read_back(self, step: _DecodeStep) -> None:
        """Wait for a queued step's tokens, append them, and end the rows that stop."""
        token_list = step.tokens.tolist()
        now = time.perf_counter()
        live = sum(s is not None for s in step.rows)
        # Step time as the clients see it: since the later of its queueing and the last read-back.
        self._record_step("decode", *step.bucket, live, max(step.queued, self._last_read_back), now)
        self._last_read_back = now
        stop_ids = self.model.tokenizer.stop_token_ids
        for seq, token in zip(step.rows, token_list, strict=True):
            if seq is None or seq.finish_reason is not None:
                continue  # an empty slot, or a row that ended after this step was queued
            seq.append(token, stop_ids, self.capacity_limit)
            if seq.finish_reason is not None:
                self._release(seq)
                self._finish(seq)

    # -- slots and bookkeeping -----------------------------------------------------------

    def _fit(self, live: list[Sequence], joining: list[Sequence] = ()) -> None:
        """Re-bucket the decode cache and rebuild the slot table from each row's slot."""
        moves = self.runner.fit(live, joining)
        for kind in moves:
            self.metrics.bucket_moves.labels(self.model.name, kind).inc()
        self._slots = [None] * self.runner.kv.batch
        for seq in live:
            self._slots[seq.slot] = seq

    def _vacate(self, seq: Sequence) -> None:
        """Free the request's decode slot (if it has one); it stays running until finished."""
        if 0 <= seq.slot < len(self._slots) and self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None
        seq.slot = -1

    def _release(self, seq: Sequence) -> None:
        """Free the request's slot (if it has one) and its scheduler entry."""
        self._vacate(seq)
        self.scheduler.finish(seq)

    def _record_step(
        self, phase: str, batch: int, size: int, rows: int, start: float, end: float | None = None
    ) -> None:
        seconds = (end or time.perf_counter()) - start
        self.metrics.record_step(StepStat(self.model.name, phase, f"b{batch}x{size}", rows, batch, seconds))

    def _finish(self, seq: Sequence, error: str | None = None) -> None:
        self.scheduler.finish(seq)
        self._keys.pop(seq.request_id, None)
        if error is not None:
            seq.finish_reason = seq.finish_reason if seq.finish_reason is FinishReason.CANCELLED else FinishReason.ERROR
        final = seq.final_event(error)
        self.metrics.record_request(
            RequestStat(
                self.model.name,
                final.finish_reason.value,
                final.prompt_tokens,
                final.completion_tokens,
                final.total_s,
                final.ttft_s,
                tuple(seq.inter_token_s),
                shutdown=error == SHUTDOWN,
            )
        )
        seq.emit(final)

    def _fail_running(self, message: str) -> None:
        for seq in list(self.scheduler.running):  # in a slot, or ending with a step in flight
            self._release(seq)
            self._finish(seq, error=message)
        self._slots, self._inflight = [], None
        self.runner.reset()
