"""The model runner: executes what the scheduler planned as compiled prefill, decode and
sampling steps at bucketed shapes, and owns the running batch: its KV cache, which request
sits in which slot, each seeded row's PRNG key and the decode step in flight. Called only
from the engine thread. The model's steps and KV-cache operations run through its executor
(:mod:`service.engine.executor`: this process, or every rank of a pipeline group)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING

import mlx.core as mx

from models.kv_cache import KVCache
from models.loader import LoadedModel
from service.engine.buckets import BucketTable
from service.engine.compile_cache import CompileCache, StepSpec
from service.engine.executor import Executor
from service.engine.group import executor_for
from service.engine.outputs import DecodeStep, RunnerOutput, input_tokens
from service.engine.prefill import Prefiller
from service.engine.prefix_cache import PrefixCache
from service.engine.selector import TokenSelector
from service.engine.sequence import Sequence, TokenLogprob
from service.metrics import StepStat

if TYPE_CHECKING:
    from service.engine.speculative import Speculator

log = logging.getLogger("stepserve.engine")


class ModelRunner:
    """Compiled steps for one model plus the decode batch's KV cache.

    The cache has ``batch`` slots (a batch bucket) and ``capacity`` positions (a capacity
    bucket). Slot ``s`` holds the sequence with ``seq.slot == s``; free slots hold garbage
    that masking keeps away from real rows.
    """

    def __init__(
        self,
        model: LoadedModel,
        buckets: BucketTable,
        cache: CompileCache,
        chunk_tokens: int = 512,
        prefix: PrefixCache | None = None,
        prefill_tokens: int = 2048,
        executor: Executor | None = None,
    ):
        self.model, self.buckets, self.compiled = model, buckets, cache
        self.executor = executor if executor is not None else executor_for(model, cache)
        self.kv: KVCache | None = None
        self.vocab = model.args.vocab_size
        self.selector = TokenSelector(model.args.vocab_size, self.step_fn)
        self.capacity_limit = buckets.capacity[-1]
        self.slots: list[Sequence | None] = []  # slot s holds the request with seq.slot == s
        self._keys: dict[str, mx.array] = {}  # request id -> its PRNG key (seeded rows only)
        self._inflight: DecodeStep | None = None
        self._last_read_back = 0.0
        self.prefix = prefix if prefix is not None else PrefixCache(block_tokens=buckets.prompt[0], budget_bytes=0)
        self.prefix.ops = self.executor  # a group's ranks each keep their own layers' blocks
        self.prefiller = Prefiller(self, chunk_tokens, self.prefix, max(prefill_tokens, chunk_tokens))
        self.speculator: Speculator | None = None  # speculative decoding, when configured (it sets this)

    # -- executing the scheduler's plan --------------------------------------------------

    @property
    def busy(self) -> bool:
        """A request holds a slot, or a decode step is in flight."""
        return self._inflight is not None or any(s is not None for s in self.slots)

    def prefill_requests(self, seqs: list[Sequence]) -> RunnerOutput:
        """Advance each request's prompt by one chunk, or prefill it whole (see
        :mod:`service.engine.prefill`); a request whose prompt is now complete gets its first
        token in ``tokens``. Call :meth:`join` with those that did not stop at it, then
        ``prefiller.save_prefixes`` once their tokens are sent (:meth:`Prefiller.save_prefixes`)."""
        out = RunnerOutput()
        self.prefiller.run(seqs, out)
        return out

    def keep_key(self, seq: Sequence, key: mx.array | None) -> None:
        """Remember a seeded request's next PRNG key (uint32 [2]); None: unseeded."""
        if key is not None:
            self._keys[seq.request_id] = key

    def join(self, seqs: list[Sequence]) -> list[str]:
        """Copy prefilled requests' KV rows into free decode slots (re-bucketing the cache
        first). Returns the bucket moves made."""
        seqs = [s for s in seqs if s.prefilled is not None]
        if not seqs:
            return []
        live = [s for s in self.slots if s is not None]
        moves = self._fit(live, seqs)
        free = iter(i for i, s in enumerate(self.slots) if s is None)
        groups: dict[int, tuple[KVCache, list[Sequence], list[int], list[int]]] = {}  # by source cache
        for seq in seqs:
            prompt_kv, row = seq.prefilled  # type: ignore[misc]
            _, members, slots, rows = groups.setdefault(id(prompt_kv), (prompt_kv, [], [], []))
            members.append(seq)
            slots.append(next(free))
            rows.append(row)
        for prompt_kv, members, slots, rows in groups.values():
            self.insert_rows(members, slots, prompt_kv, rows)
            for seq, slot in zip(members, slots, strict=True):
                self.slots[slot] = seq
                seq.prefilled = None
        return moves

    def decode_requests(self) -> RunnerOutput:
        """Queue decode step t+1 (``mx.async_eval``), then read back step t.

        Step t+1 is built from step t's tokens while they are still on the device, so the
        device runs t+1 while the engine turns t's tokens into text and events: one sync per
        step (mlx-lm's generator overlaps its steps with ``mx.async_eval`` the same way). A
        request that stops on step t's token (EOS, a stop string) was queued once more; that
        token is dropped when read back. Requests that reach ``max_tokens`` or the capacity
        limit are known in advance and not queued again.
        """
        if self.speculator is not None and (spec := self.speculator.decode(self)) is not None:
            return spec  # a verify step, read back (docs: service/engine/speculative.py)
        out = RunnerOutput()
        previous = self._inflight
        early = None
        if previous is not None and any(s is not None and s.params.stateful for s in previous.rows):
            # A grammar or a penalty needs step t's token before step t+1's logits are processed:
            # step t+1's forward pass is queued first, then t's tokens are read back and
            # observed (grammar matchers advanced) while it runs on the device, then t+1's
            # processors and sampler are queued. The device stays busy; only the sampler waits.
            early = partial(self._observe_early, previous)
        self._inflight = self._queue_decode(out, early) if any(s is not None for s in self.slots) else None
        if previous is not None:
            self._read_back(previous, out)
        return out

    @property
    def in_flight(self) -> bool:
        """A pipelined decode step is queued and not read back yet."""
        return self._inflight is not None

    def drain(self) -> RunnerOutput:
        """Read back the decode step in flight without queueing another (a speculative step
        needs every token on the host first)."""
        out, previous, self._inflight = RunnerOutput(), self._inflight, None
        if previous is not None:
            self._read_back(previous, out)
        return out

    def fit_slots(self, live: list[Sequence], extra: int = 0) -> list[str]:
        """Re-bucket the decode cache for ``live`` with room for ``extra`` more positions per
        row (:meth:`fit`) and rebuild the slot table. Returns the bucket moves made."""
        return self._fit(live, extra=extra)

    def key_of(self, seq: Sequence | None) -> mx.array | None:
        """A seeded request's current PRNG key (uint32 [2]); None for unseeded rows and empty slots."""
        return self._keys.get(seq.request_id) if seq is not None else None

    def register(self, phase: str, spec: StepSpec) -> None:
        """Add a step function (``phase``) that :meth:`step_fn` compiles per bucket (:meth:`Executor.register`)."""
        self.executor.register(phase, spec)

    def release(self, seq: Sequence) -> None:
        """Free a finished request's slot and PRNG key (thread-safe enough for the watchdog:
        it only runs once the engine thread is gone)."""
        self._vacate(seq)
        self._keys.pop(seq.request_id, None)
        seq.staging = seq.prefilled = None

    def abort(self) -> None:
        """Forget the whole batch (every request was ended): slots, keys, the step in flight."""
        self.slots, self._inflight = [], None
        self._keys.clear()
        self.reset()

    def _queue_decode(self, out: RunnerOutput, before_select: Callable[[], None] | None = None) -> DecodeStep | None:
        """Queue one decode step of every live slot (forward pass, then token selection);
        ``before_select`` runs between the two, once the forward pass is on the device."""
        prev = self._inflight
        pending = {id(s): i for i, s in enumerate(prev.rows) if s is not None} if prev else {}
        for seq in [s for s in self.slots if s is not None]:
            produced = len(seq.output_ids) + (id(seq) in pending)
            if produced >= seq.params.max_tokens or seq.position >= self.capacity_limit:
                self._vacate(seq)  # its last token is in flight; it finishes when that is read back
        live = [s for s in self.slots if s is not None]
        if not live:
            self.slots = []
            self.reset()
            return None
        # With speculation on, plain steps keep a verify step's room too: no capacity move back and forth.
        out.moves += self._fit(live, extra=self.speculator.tokens if self.speculator is not None else 0)
        rows = list(self.slots)  # a snapshot: slots change before this step is read back
        logits = self.decode(rows, input_tokens(rows, prev, pending))
        if before_select is not None:
            mx.async_eval(logits)
            before_select()
        keys = [self._keys.get(s.request_id) if s else None for s in rows]
        tokens, next_keys, lp = self.select(logits, rows, keys, queued=before_select is not None)
        for i, seq in enumerate(rows):
            if seq is not None:
                seq.position += 1
                if (key := next_keys[i]) is not None:
                    self._keys[seq.request_id] = key
        mx.async_eval(tokens, *(k for k in next_keys if k is not None), *(lp or ()))
        kv = self._cache()
        return DecodeStep(rows, tokens, time.perf_counter(), (kv.batch, kv.capacity), lp)

    def observe(self, rows: list[Sequence | None], tokens: list[int], lp: tuple | None = None) -> None:
        """Host-side state of each row after its newest token: the generated ids that the
        penalties count, the grammar's matcher, and the token's logprobs (kept on the
        sequence until its text is emitted). ``lp``: :func:`models.sampling.logprobs`'s
        arrays for these rows, or None."""
        lp_lists = [a.tolist() for a in lp] if lp is not None else None
        for i, (seq, token) in enumerate(zip(rows, tokens, strict=False)):
            if seq is None or seq.finish_reason is not None:
                continue
            seq.sampled_ids.append(token)
            if seq.matcher is not None and not seq.matcher.advance(token):
                log.warning("request %s: token %d is outside its grammar", seq.request_id, token)
            k = seq.params.logprobs
            if k is not None and lp_lists is not None:
                chosen, top_ids, top_lp = lp_lists
                top = tuple(zip(top_ids[i][:k], top_lp[i][:k], strict=True))  # type: ignore[index]
                seq.logprob_entries.append(TokenLogprob(token, chosen[i], top))  # type: ignore[index]

    def _observe(self, step: DecodeStep, tokens: list[int]) -> None:
        self.observe(step.rows, tokens, step.logprobs)

    @property
    def wait_seconds(self) -> float:
        """Seconds the engine thread has waited for the device's results (monotonic)."""
        return self.executor.wait_seconds

    def read_tokens(self, tokens: mx.array) -> list[int]:
        """Read int32 [B] tokens back to the host (waiting for the device: counted in ``wait_seconds``)."""
        return self.executor.read(tokens)

    def wait_for(self, *arrays) -> None:
        """``mx.eval`` the arrays, counting the wait in ``wait_seconds``."""
        self.executor.wait(*arrays)

    def _observe_early(self, step: DecodeStep) -> None:
        """Read ``step``'s tokens back before it is applied, and observe them (stateful rows)."""
        step.observed = self.read_tokens(step.tokens)
        self._observe(step, step.observed)

    def _read_back(self, step: DecodeStep, out: RunnerOutput) -> None:
        token_list = step.observed if step.observed is not None else self.read_tokens(step.tokens)
        if step.observed is None:
            self._observe(step, token_list)
        now = time.perf_counter()
        B, C = step.bucket
        live = sum(s is not None for s in step.rows)
        # Step time as the clients see it: since the later of its queueing and the last read-back.
        seconds = now - max(step.queued, self._last_read_back)
        out.steps.append(StepStat(self.model.name, "decode", f"b{B}x{C}", live, B, seconds))
        self._last_read_back = now
        for seq, token in zip(step.rows, token_list, strict=True):
            if seq is not None and seq.finish_reason is None:  # else: it ended after this step was queued
                out.tokens.append((seq, token))

    def _fit(self, live: list[Sequence], joining: list[Sequence] | None = None, extra: int = 0) -> list[str]:
        """Re-bucket the decode cache and rebuild the slot table from each row's slot."""
        moves = self.fit(live, joining or [], extra)
        self.slots = [None] * self._cache().batch
        for seq in live:
            self.slots[seq.slot] = seq
        return moves

    def _vacate(self, seq: Sequence) -> None:
        if 0 <= seq.slot < len(self.slots) and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
        seq.slot = -1

    def _cache(self) -> KVCache:
        if self.kv is None:
            raise RuntimeError("no decode cache: fit() the batch first")
        return self.kv

    # -- compiled functions --------------------------------------------------------------

    def step_fn(self, phase: str, batch: int = 0, size: int = 0, capacity: int = 0) -> Callable:
        """The compiled function of ``phase`` at bucket (batch, size[, capacity]); counts a hit or
        miss (:meth:`Executor.step_fn`: on this process only)."""
        return self.executor.step_fn(phase, batch, size, capacity)

    def new_kv(self, batch: int, capacity: int, ring: bool = False) -> KVCache:
        """A zeroed KV cache [batch, Hkv, capacity, D] per layer in the compute dtype, on this
        process only; ``ring``: sliding-window layers as rings (:meth:`Executor.new_kv`)."""
        return self.executor.new_kv(batch, capacity, ring)

    # -- sampling ------------------------------------------------------------------------

    def select(
        self, logits: mx.array, rows: list[Sequence | None], keys: list[mx.array | None], queued: bool = False
    ) -> tuple[mx.array, list[mx.array | None], tuple[mx.array, mx.array, mx.array] | None]:
        """Pick one token per row of ``logits`` [B, V] (:meth:`TokenSelector.select`)."""
        return self.selector.select(logits, rows, keys, queued)

    # -- prefill -------------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]]) -> tuple[mx.array, KVCache]:
        """Prefill prompts together at bucket (batch_for(n), prompt_for(longest)).

        Returns (logits float32 [B, V] at each prompt's last token, the prompts' KV cache
        [B, Hkv, T, D] per layer); rows >= n are padding.
        Raises BucketLimitError when the prompts do not fit a bucket.
        """
        n = len(prompts)
        B = self.buckets.batch_for(n)
        T = self.buckets.prompt_for(max(len(p) for p in prompts))
        rows = [p + [0] * (T - len(p)) for p in prompts] + [[0] * T] * (B - n)
        lengths = [len(p) for p in prompts] + [1] * (B - n)
        return self.executor.prefill(rows, lengths)

    # -- the decode batch ----------------------------------------------------------------

    def fit(self, live: Iterable[Sequence], joining: Iterable[Sequence] = (), extra: int = 0) -> list[str]:
        """Re-bucket the decode cache for the ``live`` sequences plus ``joining`` arrivals.

        Moves live rows into slots 0..n-1 when the batch bucket shrinks and resizes the
        capacity to the smallest bucket holding every row's next position (arrivals
        included) and ``extra`` positions after it (a verify step's proposals). Each change is
        one copy of the cache. Returns the moves made: "batch" and/or "capacity".
        """
        live, joining = sorted(live, key=lambda s: s.slot), list(joining)
        B = self.buckets.batch_for(max(len(live) + len(joining), 1))
        need = max((s.position + 1 for s in live + joining), default=1)
        C = self.buckets.capacity_for(min(need + extra, max(need, self.buckets.capacity[-1])))  # extra: if it fits
        if self.kv is None:
            self.kv = self.executor.alloc(B, C, ring=True)
            return []
        kv, moves, before = self.kv, [], self.kv.batch
        if B < kv.batch or any(s.slot >= B for s in live):
            kv = self.executor.reorder(kv, [s.slot for s in live] or [0])
            for i, s in enumerate(live):
                s.slot = i
        if kv.capacity != C:
            kv, moves = self.executor.resize(kv, C), ["capacity"]
        if kv.batch != B:
            kv = self.executor.resize_batch(kv, B)
        if B != before:
            moves.append("batch")
        self.kv = kv
        return moves

    def insert(self, seq: Sequence, slot: int, prompt_kv: KVCache, row: int) -> None:
        """Copy row ``row`` of a prefill cache into decode slot ``slot`` (see :meth:`insert_rows`)."""
        self.insert_rows([seq], [slot], prompt_kv, [row])

    def insert_rows(self, seqs: list[Sequence], slots: list[int], prompt_kv: KVCache, rows: list[int]) -> None:
        """Copy rows ``rows`` of one prefill or staging cache [B', Hkv, C', D] into decode
        slots ``slots``: one indexed copy per layer and keys/values for the whole group (on a
        GPU each copy is a kernel launch). Only the first ``min(C', C)`` positions are copied:
        a slot's positions past its sequence hold garbage that attention masks away.

        Raises:
            ValueError: the decode cache's capacity cannot hold a sequence (call :meth:`fit` first).
        """
        kv = self._cache()
        for seq in seqs:
            if seq.position >= kv.capacity:
                raise ValueError(f"sequence at position {seq.position} does not fit capacity {kv.capacity}")
        self.executor.insert_rows(kv, prompt_kv, slots, rows, [seq.position for seq in seqs])
        for seq, slot in zip(seqs, slots, strict=True):
            seq.slot = slot

    def decode(self, slots: list[Sequence | None], tokens: mx.array | None = None) -> mx.array:
        """One decode step over all slots; returns logits float32 [B, V] (lazy).

        ``tokens``: int32 [B], each slot's input token, possibly still lazy (the previous
        step's output); default: each sequence's ``last_token``. Each row's token is
        written at ``seq.position``.

        Raises:
            ValueError: a position is beyond the cache's capacity (call :meth:`fit` first).
        """
        kv = self._cache()
        positions_list = [s.position if s else 0 for s in slots]
        if max(positions_list) >= kv.capacity:  # a scatter past the buffer would corrupt memory
            raise ValueError(f"position {max(positions_list)} is beyond the KV capacity {kv.capacity}")
        if tokens is None:
            tokens = mx.array([s.last_token if s else 0 for s in slots], mx.int32)
        logits, self.kv = self.executor.decode(kv, tokens, positions_list)
        return logits

    def reset(self) -> None:
        """Drop the decode cache (no sequences left)."""
        self.kv = None

    # -- warm-up -------------------------------------------------------------------------

    def warm(self, phase: str, batch: int, size: int, capacity: int = 0, repeats: int = 3) -> bool:
        """Compile and run one bucket's step on dummy inputs (:meth:`Executor.warm`); returns
        whether the bucket runs compiled."""
        return self.executor.warm(phase, batch, size, capacity, repeats)
