"""The decode batch over a paged KV pool: each running request holds the blocks its tokens use
(:class:`service.engine.block_pool.BlockPool`), not a row of the batch's worst-case capacity.

A request joins by taking blocks for its prompt and next position and having its prefilled keys
and values copied into them (:meth:`Executor.write_blocks`); each decode step first gives every
row the blocks its next positions need, then runs over the rows' block tables
(:class:`service.engine.executor.PagedTables`) at a batch bucket and a capacity bucket, as the
static batch does; a finished request's blocks go back to the pool. A bucket move is a wider or
narrower table: nothing is copied. When a step's blocks cannot be had, the engine preempts
(:meth:`Engine._make_room`). Called only from the engine thread.
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx

from service.engine.batch import DecodeBatch
from service.engine.block_pool import NULL_BLOCK, BlockPool, NoFreeBlocks
from service.engine.buckets import BucketTable
from service.engine.executor import Executor, PagedTables
from service.engine.sequence import Sequence


class PagedDecodeBatch(DecodeBatch):
    """:class:`DecodeBatch` whose rows live in ``blocks`` (the host side of the executor's pool).

    Args:
        buckets: the bucket table; every capacity bucket is a multiple of the block size.
        executor: where the pool is (:meth:`Executor.use_paged` ran).
        blocks: the block pool's bookkeeping, of the executor's pool's size.
    """

    def __init__(self, buckets: BucketTable, executor: Executor, blocks: BlockPool):
        self.tables: PagedTables | None = None  # the rows' block tables at the current buckets
        super().__init__(buckets, executor)
        self.blocks = blocks
        self.preemptions = 0  # requests preempted so far (the engine counts them)
        self._growing = True  # fit() gives the rows their next blocks (not while requests join)

    @property
    def kv(self) -> PagedTables | None:  # type: ignore[override]
        """The rows' block tables (what a decode step runs over; None before the first fit)."""
        return self.tables

    @kv.setter
    def kv(self, tables: PagedTables | None) -> None:  # a step hands its tables back; reset() drops them
        self.tables = tables

    # -- blocks ------------------------------------------------------------------------------

    def blocks_short(self, live: Iterable[Sequence], extra: int = 0) -> int:
        """New blocks the next step of ``live`` needs (each row's position and ``extra`` more)
        beyond those the pool can give now (0: it fits)."""
        bt, need = self.blocks.block_tokens, 0
        for seq in live:
            have = len(self.blocks.block_table(id(seq))) if id(seq) in self.blocks else 0
            need += max(0, -(-min(seq.position + 1 + extra, self.capacity_limit) // bt) - have)
        return max(0, need - self.blocks.num_available)

    def _grow(self, seq: Sequence, extra: int) -> None:
        """Give ``seq`` blocks for positions up to ``position + extra`` (at most the capacity
        limit). Raises NoFreeBlocks (nothing changed for this row)."""
        want = min(seq.position + 1 + extra, self.capacity_limit)
        have = self.blocks.num_tokens(id(seq))
        if want > have:
            self.blocks.append_slots(id(seq), [0] * (want - have))

    def free(self, seq: Sequence) -> None:
        """Give ``seq``'s blocks back (idempotent)."""
        if id(seq) in self.blocks:
            self.blocks.free(id(seq))

    # -- the DecodeBatch API -------------------------------------------------------------------

    def join(self, seqs: list[Sequence]) -> list[str]:
        """Give each prefilled request (``seq.prefilled``) blocks for its prompt and next
        position and copy its keys and values into them, in a free slot. A request whose blocks
        the pool cannot give now stays out (``seq.prefilled`` kept): the engine preempts it.
        Returns the bucket moves made."""
        seqs = [s for s in seqs if s.prefilled is not None]
        placed = []
        for seq in seqs:
            try:
                self.blocks.allocate(id(seq), [0] * (seq.position + 1))
            except NoFreeBlocks:
                continue
            placed.append(seq)
        if not placed:
            return []
        self._growing = False  # the decode step's fit grows the rows, once the engine made room
        try:
            moves = self.refit(self.live, placed)
        finally:
            self._growing = True
        free = iter(i for i, s in enumerate(self.slots) if s is None)
        for seq in placed:
            kv, row = seq.prefilled  # type: ignore[misc]
            self.executor.write_blocks(kv, row, self.blocks.block_table(id(seq)), seq.position)
            slot = next(free)
            seq.slot, self.slots[slot], seq.prefilled = slot, seq, None
        return moves

    def fit(self, live: Iterable[Sequence], joining: Iterable[Sequence] = (), extra: int = 0) -> list[str]:
        """Pick the batch and capacity buckets for ``live`` plus ``joining`` (as the static batch
        does) and, before a decode step (not while requests join), give every live row the blocks
        its next ``1 + extra`` positions need (raises NoFreeBlocks when the pool cannot: the
        engine makes room first, :meth:`blocks_short`).
        Rows move to slots 0..n-1 when the batch bucket shrinks; nothing is copied."""
        live, joining = sorted(live, key=lambda s: s.slot), list(joining)
        B = self.buckets.batch_for(max(len(live) + len(joining), 1))
        need = max((s.position + 1 for s in live + joining), default=1)
        C = self.buckets.capacity_for(min(need + extra, max(need, self.capacity_limit)))
        for seq in live if self._growing else ():
            self._grow(seq, extra if seq.position + 1 + extra <= C else 0)
        before, moves = self.tables, []
        if before is not None and (B < before.batch or any(s.slot >= B for s in live)):
            for i, s in enumerate(live):
                s.slot = i
        if before is not None and before.capacity != C:
            moves.append("capacity")
        if before is not None and before.batch != B:
            moves.append("batch")
        self.tables = PagedTables(mx.zeros((B, C // self.blocks.block_tokens), mx.int32), B, C)
        return moves

    def cache(self) -> PagedTables:  # type: ignore[override]
        """The rows' block tables at the current buckets (int32 [B, C / bt], null-block padded).

        Raises:
            RuntimeError: before the first :meth:`fit`.
        """
        if self.tables is None:
            raise RuntimeError("no decode batch: fit() the batch first")
        B, C = self.tables.batch, self.tables.capacity
        M = C // self.blocks.block_tokens
        rows = []
        for seq in self.slots + [None] * (B - len(self.slots)):
            table = self.blocks.block_table(id(seq))[:M] if seq is not None else []
            rows.append(table + [NULL_BLOCK] * (M - len(table)))
        self.tables = PagedTables(mx.array(rows, mx.int32), B, C)
        return self.tables

    def release(self, seq: Sequence) -> None:
        """Free a finished request's slot, key and blocks."""
        super().release(seq)
        self.free(seq)

    def abort(self) -> None:
        """Forget the whole batch and give every block back."""
        for seq in self.live:
            self.free(seq)
        super().abort()
