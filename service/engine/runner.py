"""The model runner: runs the decode batch's plain decode steps, pipelined: step t+1 is queued
on the device before step t's tokens are read back. Called only from the engine thread. Its
steps run through the executor (:mod:`service.engine.executor`: this process, or every rank of
a pipeline group); the batch it decodes (:class:`~service.engine.batch.DecodeBatch`) and the
token selector are the engine's, handed to it at construction."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import mlx.core as mx

from service.engine.batch import DecodeBatch
from service.engine.executor import Executor
from service.engine.outputs import DecodeStep, RunnerOutput, input_tokens
from service.engine.selector import TokenSelector, observe
from service.engine.sequence import Sequence
from service.metrics import StepStat


class ModelRunner:
    """Pipelined plain decode steps over a decode batch.

    Args:
        executor: where the steps run.
        selector: picks each row's token from a step's logits.
        batch: the decode batch (its cache and slots) the steps run over.
    """

    def __init__(self, executor: Executor, selector: TokenSelector, batch: DecodeBatch):
        self.executor, self.selector, self.batch = executor, selector, batch
        self.model_name = executor.model.name
        self._inflight: DecodeStep | None = None
        self._last_read_back = 0.0

    @property
    def busy(self) -> bool:
        """A request holds a slot, or a decode step is in flight."""
        return self._inflight is not None or any(s is not None for s in self.batch.slots)

    @property
    def in_flight(self) -> bool:
        """A pipelined decode step is queued and not read back yet."""
        return self._inflight is not None

    def decode_requests(self, extra: int = 0) -> RunnerOutput:
        """Queue decode step t+1 (``mx.async_eval``), then read back step t.

        Step t+1 is built from step t's tokens while they are still on the device, so the
        device runs t+1 while the engine turns t's tokens into text and events: one sync per
        step (mlx-lm's generator overlaps its steps with ``mx.async_eval`` the same way). A
        request that stops on step t's token (EOS, a stop string) was queued once more; that
        token is dropped when read back. Requests that reach ``max_tokens`` or the capacity
        limit are known in advance and not queued again. ``extra``: positions per row the
        cache keeps room for beyond the next (a verify step's proposals, with speculation on:
        no capacity move back and forth between plain and verify steps).
        """
        out = RunnerOutput()
        previous = self._inflight
        early = None
        if previous is not None and any(s is not None and s.params.stateful for s in previous.rows):
            # A grammar or a penalty needs step t's token before step t+1's logits are processed:
            # step t+1's forward pass is queued first, then t's tokens are read back and
            # observed (grammar matchers advanced) while it runs on the device, then t+1's
            # processors and sampler are queued. The device stays busy; only the sampler waits.
            early = partial(self._observe_early, previous)
        live = any(s is not None for s in self.batch.slots)
        self._inflight = self._queue_decode(out, early, extra) if live else None
        if previous is not None:
            self._read_back(previous, out)
        return out

    def drain(self) -> RunnerOutput:
        """Read back the decode step in flight without queueing another (a speculative step
        needs every token on the host first)."""
        out, previous, self._inflight = RunnerOutput(), self._inflight, None
        if previous is not None:
            self._read_back(previous, out)
        return out

    def abort(self) -> None:
        """Forget the step in flight (every request was ended; the engine drops the batch)."""
        self._inflight = None

    def _queue_decode(
        self, out: RunnerOutput, before_select: Callable[[], None] | None = None, extra: int = 0
    ) -> DecodeStep | None:
        """Queue one decode step of every live slot (forward pass, then token selection);
        ``before_select`` runs between the two, once the forward pass is on the device."""
        batch, prev = self.batch, self._inflight
        pending = {id(s): i for i, s in enumerate(prev.rows) if s is not None} if prev else {}
        for seq in batch.live:
            produced = len(seq.output_ids) + (id(seq) in pending)
            if produced >= seq.params.max_tokens or seq.position >= batch.capacity_limit:
                batch.vacate(seq)  # its last token is in flight; it finishes when that is read back
        live = batch.live
        if not live:
            batch.slots = []
            batch.reset()
            return None
        out.moves += batch.refit(live, extra=extra)
        rows = list(batch.slots)  # a snapshot: slots change before this step is read back
        logits = self.decode(rows, input_tokens(rows, prev, pending))
        if before_select is not None:
            mx.async_eval(logits)
            before_select()
        keys = [batch.key_of(s) for s in rows]
        tokens, next_keys, lp = self.selector.select(logits, rows, keys, queued=before_select is not None)
        for i, seq in enumerate(rows):
            if seq is not None:
                seq.position += 1
                batch.keep_key(seq, next_keys[i])
        mx.async_eval(tokens, *(k for k in next_keys if k is not None), *(lp or ()))
        kv = batch.cache()
        return DecodeStep(rows, tokens, time.perf_counter(), (kv.batch, kv.capacity), lp)

    def _observe_early(self, step: DecodeStep) -> None:
        """Read ``step``'s tokens back before it is applied, and observe them (stateful rows)."""
        step.observed = self.executor.read(step.tokens)
        observe(step.rows, step.observed, step.logprobs)

    def _read_back(self, step: DecodeStep, out: RunnerOutput) -> None:
        token_list = step.observed if step.observed is not None else self.executor.read(step.tokens)
        if step.observed is None:
            observe(step.rows, token_list, step.logprobs)
        now = time.perf_counter()
        B, C = step.bucket
        live = sum(s is not None for s in step.rows)
        # Step time as the clients see it: since the later of its queueing and the last read-back.
        seconds = now - max(step.queued, self._last_read_back)
        out.steps.append(StepStat(self.model_name, "decode", f"b{B}x{C}", live, B, seconds))
        self._last_read_back = now
        for seq, token in zip(step.rows, token_list, strict=True):
            if seq is not None and seq.finish_reason is None:  # else: it ended after this step was queued
                out.tokens.append((seq, token))

    def decode(self, slots: list[Sequence | None], tokens: mx.array | None = None) -> mx.array:
        """One decode step over all slots of the batch; returns logits float32 [B, V] (lazy).

        ``tokens``: int32 [B], each slot's input token, possibly still lazy (the previous
        step's output); default: each sequence's ``last_token``. Each row's token is
        written at ``seq.position``.

        Raises:
            ValueError: a position is beyond the cache's capacity (call :meth:`DecodeBatch.fit` first).
        """
        kv = self.batch.cache()
        positions_list = [s.position if s else 0 for s in slots]
        if max(positions_list) >= kv.capacity:  # a scatter past the buffer would corrupt memory
            raise ValueError(f"position {max(positions_list)} is beyond the KV capacity {kv.capacity}")
        if tokens is None:
            tokens = mx.array([s.last_token if s else 0 for s in slots], mx.int32)
        logits, kv = self.executor.decode(kv, tokens, positions_list)
        self.batch.keep_cache(kv)
        return logits
