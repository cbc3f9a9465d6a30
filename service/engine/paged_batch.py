"""The decode batch over a paged KV pool: each running request holds the blocks its tokens use
(:class:`service.engine.block_pool.BlockPool`), not a row of the batch's worst-case capacity.

A request joins by taking blocks for its prompt and next position and having its prefilled keys
and values copied into them (:meth:`Executor.write_blocks`); each decode step first gives every
row the blocks its next positions need, then runs over the rows' block tables
(:class:`service.engine.executor.PagedTables`) at a batch bucket and a capacity bucket, as the
static batch does; a finished request's blocks go back to the pool. A bucket move is a wider or
narrower table: nothing is copied. When a step's blocks cannot be had, the engine preempts
(:meth:`Engine._make_room`). Called only from the engine thread.

The table is kept between steps (a host copy and the device array made from it) and changed only
where a row changed: a join, a row's next block, a vacated slot (finished or preempted), a bucket
move. A row takes blocks whole, so a steady decode step touches no row's table.
"""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx
import numpy as np

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
        super().__init__(buckets, executor)
        self.blocks = blocks
        self.preemptions = 0  # requests preempted so far (the engine counts them)
        self._growing = True  # fit() gives the rows their next blocks (not while requests join)
        self._bucket: tuple[int, int] | None = None  # (batch, capacity) buckets; None: no batch
        self._host = np.zeros((0, 0), np.int32)  # the table on the host, int32 [B, C / bt]
        self._tables: PagedTables | None = None  # the table on the device; None: remake from _host
        self._rebuild = True  # every row of _host must be rewritten (a bucket move, slots renumbered)
        self._stale: set[int] = set()  # slots whose row of _host must be rewritten

    # -- blocks ------------------------------------------------------------------------------

    def blocks_short(self, live: Iterable[Sequence], extra: int = 0) -> int:
        """New blocks the next step of ``live`` needs (each row's position and ``extra`` more)
        beyond those the pool can give now (0: it fits)."""
        pool, need = self.blocks, 0
        for seq in live:
            have = pool.blocks_for(pool.num_tokens(id(seq))) if id(seq) in pool else 0
            need += max(0, pool.blocks_for(min(seq.position + 1 + extra, self.capacity_limit)) - have)
        return max(0, need - pool.num_available)

    def _grow(self, seq: Sequence, extra: int) -> None:
        """Give ``seq`` whole blocks for positions up to ``position + extra`` (at most the
        capacity limit, a multiple of the block size), its table row rewritten at the next
        :meth:`cache` when it took one. Raises NoFreeBlocks (nothing changed for this row)."""
        pool, bt = self.blocks, self.blocks.block_tokens
        have = pool.num_tokens(id(seq))
        if seq.position + 1 + extra <= have:
            return  # the steady step: its blocks hold the next positions already
        want = min(pool.blocks_for(seq.position + 1 + extra) * bt, self.capacity_limit)
        if want > have:
            pool.append_slots(id(seq), [0] * (want - have))
            self._stale.add(seq.slot)

    def free(self, seq: Sequence) -> None:
        """Give ``seq``'s blocks back (idempotent; vacate its slot first)."""
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
            self._stale.add(slot)
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
        before, moves = self._bucket, []
        if before is None:
            self._rebuild = True
        else:
            if B < before[0] or any(s.slot >= B for s in live):
                for i, s in enumerate(live):
                    s.slot = i
                self._rebuild = True
            if before[1] != C:
                moves.append("capacity")
            if before[0] != B:
                moves.append("batch")
            self._rebuild |= bool(moves)
        self._bucket = (B, C)
        return moves

    def cache(self) -> PagedTables:  # type: ignore[override]
        """The rows' block tables at the current buckets (int32 [B, C / bt], null-block padded):
        the table of the last call, with the rows changed since rewritten.

        Raises:
            RuntimeError: before the first :meth:`fit`.
        """
        if self._bucket is None:
            raise RuntimeError("no decode batch: fit() the batch first")
        B, C = self._bucket
        rows: dict[int, Sequence | None] | None = None  # the rows to rewrite: slot -> its request
        if self._rebuild:
            self._host = np.full((B, C // self.blocks.block_tokens), NULL_BLOCK, np.int32)
            rows = {s.slot: s for s in self.slots if s is not None}  # by seq.slot: fit may have renumbered
        elif self._stale:
            rows = {i: self.slots[i] if i < len(self.slots) else None for i in self._stale}
        if rows is not None:
            for slot, seq in rows.items():
                if 0 <= slot < B:
                    self._write_row(slot, seq)
            self._rebuild, self._stale, self._tables = False, set(), None
        if self._tables is None:
            self._tables = PagedTables(mx.array(self._host), B, C)
        return self._tables

    def _write_row(self, slot: int, seq: Sequence | None) -> None:
        """Row ``slot`` of the host table: ``seq``'s blocks (None: the null block throughout)."""
        row = self._host[slot]
        table = self.blocks.block_table(id(seq))[: len(row)] if seq is not None and id(seq) in self.blocks else []
        row[: len(table)] = table
        row[len(table) :] = NULL_BLOCK

    def keep_cache(self, kv: PagedTables) -> None:  # type: ignore[override]
        """A paged step wrote the executor's pool; its block tables are unchanged: nothing to keep."""

    def vacate(self, seq: Sequence) -> None:
        """Free ``seq``'s slot; its table row becomes null blocks at the next :meth:`cache` (an
        empty slot's padded write must land in no block a request holds)."""
        if 0 <= seq.slot < len(self.slots) and self.slots[seq.slot] is seq:
            self._stale.add(seq.slot)
        super().vacate(seq)

    def reset(self) -> None:
        """Drop the block tables (no sequences left); the blocks stay with their requests."""
        super().reset()
        self._bucket, self._tables, self._rebuild, self._stale = None, None, True, set()

    def release(self, seq: Sequence) -> None:
        """Free a finished request's slot, key and blocks."""
        super().release(seq)
        self.free(seq)

    def abort(self) -> None:
        """Forget the whole batch and give every block back."""
        for seq in self.live:
            self.free(seq)
        super().abort()
