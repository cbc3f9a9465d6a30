"""The decode batch: its KV cache, which request sits in which slot, and each seeded row's PRNG
key. The engine joins prefilled requests into it and releases finished ones; the runner's plain
decode steps and the speculator's verify steps run over it (each is handed it: neither holds
the other). Called only from the engine thread. Its KV-cache operations run through the
executor (:mod:`service.engine.executor`: this process, or every rank of a pipeline group)."""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx

from models.kv_cache import KVCache
from service.engine.buckets import BucketTable
from service.engine.executor import Executor
from service.engine.sequence import Sequence


class DecodeBatch:
    """The running batch's decode cache and slot table.

    The cache has ``batch`` slots (a batch bucket) and ``capacity`` positions (a capacity
    bucket). Slot ``s`` holds the sequence with ``seq.slot == s``; free slots hold garbage
    that masking keeps away from real rows.

    Args:
        buckets: the bucket table (batch and capacity buckets; the largest capacity bounds a row).
        executor: where the cache's operations run.
    """

    def __init__(self, buckets: BucketTable, executor: Executor):
        self.buckets, self.executor = buckets, executor
        self.kv: KVCache | None = None
        self.slots: list[Sequence | None] = []  # slot s holds the request with seq.slot == s
        self.capacity_limit = buckets.capacity[-1]
        self._keys: dict[str, mx.array] = {}  # request id -> its PRNG key (seeded rows only)

    @property
    def live(self) -> list[Sequence]:
        """The requests holding a slot, in slot order."""
        return [s for s in self.slots if s is not None]

    @property
    def has_cache(self) -> bool:
        """Whether a step can run over the batch now (:meth:`fit` made its cache)."""
        return self.kv is not None

    def reserve(self, seq: Sequence, extra: int) -> int:
        """Make room for ``seq``'s ``extra`` positions after its next (a verify step's proposals)
        and return how many of them it has: all of them here, as :meth:`fit` with ``extra`` made
        the capacity (a paged batch may have fewer, :meth:`PagedDecodeBatch.reserve`)."""
        return extra

    def keep_key(self, seq: Sequence, key: mx.array | None) -> None:
        """Remember a seeded request's next PRNG key (uint32 [2]); None: unseeded."""
        if key is not None:
            self._keys[seq.request_id] = key

    def key_of(self, seq: Sequence | None) -> mx.array | None:
        """A seeded request's current PRNG key (uint32 [2]); None for unseeded rows and empty slots."""
        return self._keys.get(seq.request_id) if seq is not None else None

    def join(self, seqs: list[Sequence]) -> list[str]:
        """Copy prefilled requests' KV rows (``seq.prefilled``) into free decode slots
        (re-bucketing the cache first). Returns the bucket moves made."""
        seqs = [s for s in seqs if s.prefilled is not None]
        if not seqs:
            return []
        moves = self.refit(self.live, seqs)
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

    def refit(self, live: list[Sequence], joining: list[Sequence] | None = None, extra: int = 0) -> list[str]:
        """Re-bucket the decode cache for ``live`` plus ``joining`` with room for ``extra`` more
        positions per row (:meth:`fit`) and rebuild the slot table from each row's slot.
        Returns the bucket moves made."""
        moves = self.fit(live, joining or [], extra)
        self.slots = [None] * self.cache().batch
        for seq in live:
            self.slots[seq.slot] = seq
        return moves

    def fit(self, live: Iterable[Sequence], joining: Iterable[Sequence] = (), extra: int = 0) -> list[str]:
        """Re-bucket the decode cache for the ``live`` sequences plus ``joining`` arrivals.

        Moves live rows into slots 0..n-1 when the batch bucket shrinks and resizes the
        capacity to the smallest bucket holding every row's next position (arrivals
        included) and ``extra`` positions after it (a verify step's proposals). Each change is
        one copy of the cache. Returns the moves made: "batch" and/or "capacity".
        """
        live, joining = sorted(live, key=lambda s: s.slot), list(joining)
        B = self.buckets.batch_for(max(len(live) + len(joining), 1))
        # A row at the capacity limit has its last token in flight and steps no more (the runner
        # vacates it before the next step): it needs no room past the limit while others join.
        need = min(max((s.position + 1 for s in live + joining), default=1), self.capacity_limit)
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
        kv = self.cache()
        for seq in seqs:
            if seq.position >= kv.capacity:
                raise ValueError(f"sequence at position {seq.position} does not fit capacity {kv.capacity}")
        self.executor.insert_rows(kv, prompt_kv, slots, rows, [seq.position for seq in seqs])
        for seq, slot in zip(seqs, slots, strict=True):
            seq.slot = slot

    def vacate(self, seq: Sequence) -> None:
        """Free ``seq``'s slot (its KV rows stay, masked, until another row takes it)."""
        if 0 <= seq.slot < len(self.slots) and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
        seq.slot = -1

    def release(self, seq: Sequence) -> None:
        """Free a finished request's slot and PRNG key (thread-safe enough for the watchdog:
        it only runs once the engine thread is gone)."""
        self.vacate(seq)
        self._keys.pop(seq.request_id, None)
        seq.staging = seq.prefilled = None

    def abort(self) -> None:
        """Forget the whole batch (every request was ended): slots, keys and the cache."""
        self.slots = []
        self._keys.clear()
        self.reset()

    def reset(self) -> None:
        """Drop the decode cache (no sequences left)."""
        self.kv = None

    def cache(self) -> KVCache:
        """The decode cache: what a decode or verify step runs over ([B, Hkv, C, D] per layer).
        Raises RuntimeError before the first :meth:`fit`."""
        if self.kv is None:
            raise RuntimeError("no decode cache: fit() the batch first")
        return self.kv

    def keep_cache(self, kv: KVCache) -> None:
        """Keep the decode cache a step over :meth:`cache` returned (the step wrote new buffers)."""
        self.kv = kv
