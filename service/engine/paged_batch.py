"""The decode batch over a paged KV pool: each running request holds the blocks its tokens use
(:class:`service.engine.block_pool.BlockPool`), not a row of the batch's worst-case capacity.

A request takes its prompt's blocks when it is admitted (:meth:`Engine._fits`), the leading full
blocks another request already computed referenced, not copied (a prefix hit: prefill starts
after them). It joins by having the keys and values it prefilled copied into its other blocks
(:meth:`Executor.write_blocks`), or, where the model prefills in its blocks
(:attr:`Executor.in_blocks`), with them there already (and published chunk by chunk as they
were written), and its full blocks are then published for later requests' hits;
each decode step first gives every row the blocks its next positions need (a copy of a shared
partial last block first: copy-on-write), then runs over the rows' block tables
(:class:`service.engine.executor.PagedTables`) at a batch bucket and a capacity bucket, as the
static batch does; a finished request's blocks go back to the pool. A bucket move is a wider or
narrower table: nothing is copied. When a step's blocks cannot be had, the engine preempts
(:meth:`Engine._make_room`); the unreferenced cached blocks are taken (least recently used
first) before that. A request that ends or is preempted publishes the full blocks of what it
generated as well, so a resumed request (or a next turn that repeats the answer) hits them.
Called only from the engine thread.

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
from service.engine.executor import Executor, InBlocks, PagedTables
from service.engine.sequence import FinishReason, Sequence
from service.metrics import PrefixCacheStat


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
        self._written: set[int] = set()  # id() of the requests whose keys and values are in their blocks
        self._reported = (0, 0, 0, 0)  # the pool's prefix counters and cached blocks at the last take_prefix_stat

    # -- blocks ------------------------------------------------------------------------------

    def blocks_short(self, live: Iterable[Sequence], extra: int = 0) -> int:
        """New blocks the next step of ``live`` needs (each row's position and ``extra`` more,
        a copy-on-write of a shared partial last block included) beyond those the pool can give
        now, cached blocks counted as available (0: it fits)."""
        pool, need = self.blocks, 0
        for seq in live:
            if id(seq) not in pool:
                need += pool.blocks_for(min(seq.position + 1 + extra, self.capacity_limit))
            elif (more := self._wanted(seq, extra)) > 0:
                need += pool.append_cost(id(seq), more)
        return max(0, need - pool.num_available)

    def _wanted(self, seq: Sequence, extra: int) -> int:
        """Positions ``seq`` must take for its positions up to ``position + extra``: whole blocks,
        up to the capacity limit (a multiple of the block size); 0 when it holds them."""
        pool = self.blocks
        have = pool.num_tokens(id(seq))
        if seq.position + 1 + extra <= have:
            return 0  # the steady step: its blocks hold the next positions already
        return max(0, min(pool.blocks_for(seq.position + 1 + extra) * pool.block_tokens, self.capacity_limit) - have)

    def _grow(self, seq: Sequence, extra: int) -> None:
        """Give ``seq`` whole blocks for positions up to ``position + extra`` (:meth:`_wanted`),
        its table row rewritten at the next :meth:`cache` when it took one; a shared partial
        last block is copied first (the device copy is queued before the step). Raises
        NoFreeBlocks (nothing changed for this row)."""
        if more := self._wanted(seq, extra):
            copies = self.blocks.append_slots(id(seq), [0] * more)  # tokens named when published (free)
            if copies:
                self.executor.copy_pool_blocks(copies)
            self._stale.add(seq.slot)

    def reserve(self, seq: Sequence, extra: int) -> int:
        """Before a verify step (after :meth:`fit`): give ``seq`` the blocks its ``extra``
        positions after its next need (whole blocks, a copy of a shared partial last block first,
        as a decode step's), and return how many of those positions it holds, 0..``extra``.

        Best effort, never preempting: when the pool cannot give a block now (cached blocks
        counted as available), the row keeps what it holds and proposes only as many tokens as
        fit in it this step (none past its last block; its other positions of the step, padding,
        are written into the null block, which no request reads). Blocks a row took for
        proposals that were then rejected stay with it for its next steps (a row takes blocks
        whole anyway) and go back with the rest of its blocks when it ends or is preempted.
        A verify step writes only the row's own, unshared blocks: published blocks are full
        blocks before its position, and a shared partial block is copied when the row first
        takes a block past it (:meth:`BlockPool.append_slots`)."""
        if extra > 0 and self.capacity_limit > seq.position + 1:
            try:
                self._grow(seq, min(extra, self.capacity_limit - seq.position - 1))
            except NoFreeBlocks:
                pass
        held = self.blocks.num_tokens(id(seq)) if id(seq) in self.blocks else 0
        return max(0, min(extra, held - seq.position - 1))

    def free(self, seq: Sequence, publish: bool = False) -> None:
        """Give ``seq``'s blocks back (idempotent; vacate its slot first). ``publish``: its
        keys and values are in its blocks up to ``seq.position`` (it joined, and no step failed):
        the full blocks among them are published first, the generated tokens included, so a
        resumed request or a later prompt repeating them hits them."""
        pool, key = self.blocks, id(seq)
        if key not in pool:
            return
        if publish and key in self._written and pool.caching:
            start, ids = pool.num_computed(key), seq.prompt_ids + seq.output_ids
            end = min(seq.position, len(ids), pool.num_tokens(key))
            if end > start:
                pool.set_tokens(key, start, ids[start:end])
                pool.mark_computed(key, end)
        self._written.discard(key)
        pool.free(key)

    @property
    def prefix_moved(self) -> bool:
        """Whether the pool's prefix counters or its cached blocks changed since the previous
        :meth:`take_prefix_stat`."""
        pool = self.blocks
        return (pool.queried_tokens, pool.hit_tokens, pool.evicted_blocks, pool.num_cached) != self._reported

    def take_prefix_stat(self, model: str) -> PrefixCacheStat:
        """The pool's prefix counters' increase since the previous call (tokens looked up and
        hit at admission, blocks evicted) and the bytes of its cached blocks now, as the prefix
        cache reports them (:meth:`service.metrics.Metrics.record_prefix_cache`)."""
        pool = self.blocks
        now = (pool.queried_tokens, pool.hit_tokens, pool.evicted_blocks, pool.num_cached)
        queried, hit, evicted = (a - b for a, b in zip(now[:3], self._reported[:3], strict=True))
        self._reported = now
        device = self.executor.pool
        block_bytes = device.nbytes // device.num_blocks if device is not None else 0
        return PrefixCacheStat(model, queried, hit, evicted, now[3] * block_bytes)

    # -- the DecodeBatch API -------------------------------------------------------------------

    def join(self, seqs: list[Sequence]) -> list[str]:
        """Place each prefilled request (``seq.prefilled``) in a free slot: the keys and values it
        prefilled are copied into its blocks after its prefix hit's (taken at admission; a
        request that holds none yet takes them here, and one the pool cannot give now stays out,
        ``seq.prefilled`` kept: the engine preempts it), and its full blocks are published. A
        request prefilled in the same cache row as an earlier one of the call (one prompt sent
        twice at once) shares that one's blocks instead, its partial last block too: the first of
        them to write there gets a copy (copy-on-write). Returns the bucket moves made."""
        seqs = [s for s in seqs if s.prefilled is not None]
        pool, placed = self.blocks, []
        first: dict[tuple[int, int], Sequence] = {}  # (cache, row) -> the request written from it
        for seq in seqs:
            kv, row = seq.prefilled  # type: ignore[misc]
            twin = first.get((id(kv), row))
            if twin is not None and twin.prefill_ids == seq.prefill_ids:
                if id(seq) in pool:
                    pool.free(id(seq))
                pool.fork(id(twin), id(seq))
            else:
                if id(seq) not in pool:
                    try:
                        pool.allocate(id(seq), seq.prefill_ids)
                    except NoFreeBlocks:
                        continue
                first.setdefault((id(kv), row), seq)
                self._write_prompt(seq)
            self._written.add(id(seq))
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
            slot = next(free)
            seq.slot, self.slots[slot], seq.prefilled = slot, seq, None
            self._stale.add(slot)
        return moves

    def _write_prompt(self, seq: Sequence) -> None:
        """Copy the keys and values ``seq`` prefilled (``seq.prefilled``) into its blocks after
        its prefix hit's (unless it prefilled in them: :class:`InBlocks`), and publish its
        prompt's full blocks."""
        pool, (kv, row) = self.blocks, seq.prefilled  # type: ignore[misc]
        if not isinstance(kv, InBlocks):  # prefilled in its blocks already: nothing to copy
            table, start = pool.block_table(id(seq)), pool.num_computed(id(seq))
            self.executor.write_blocks(kv, row, table[start // pool.block_tokens :], seq.position, start)
        pool.mark_computed(id(seq), len(seq.prefill_ids))
        self._written.add(id(seq))

    def fit(self, live: Iterable[Sequence], joining: Iterable[Sequence] = (), extra: int = 0) -> list[str]:
        """Pick the batch and capacity buckets for ``live`` plus ``joining`` (as the static batch
        does, the capacity with room for ``extra`` positions more) and, before a decode step (not
        while requests join), give every live row the blocks its next position needs (raises
        NoFreeBlocks when the pool cannot: the engine makes room first, :meth:`blocks_short`); a
        verify step's ``extra`` positions get their blocks from :meth:`reserve`.
        Rows move to slots 0..n-1 when the batch bucket shrinks; nothing is copied."""
        live, joining = sorted(live, key=lambda s: s.slot), list(joining)
        B = self.buckets.batch_for(max(len(live) + len(joining), 1))
        # A row at the capacity limit has its last token in flight and steps no more (the runner
        # vacates it before the next step): it needs no room past the limit while others join.
        need = min(max((s.position + 1 for s in live + joining), default=1), self.capacity_limit)
        C = self.buckets.capacity_for(min(need + extra, max(need, self.capacity_limit)))
        for seq in live if self._growing else ():
            self._grow(seq, 0)  # a verify step's ``extra`` positions: reserve(), best effort
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

    @property
    def has_cache(self) -> bool:
        """Whether a step can run over the batch now (:meth:`fit` picked its buckets)."""
        return self._bucket is not None

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
        """Free a finished request's slot, key and blocks, publishing its full blocks unless it
        failed (:meth:`free`): one that ended at its first token, before it joined, has the keys
        and values it prefilled written into its blocks first, so its prompt is hit later."""
        publish = seq.finish_reason is not FinishReason.ERROR
        if publish and seq.prefilled is not None and id(seq) in self.blocks and self.blocks.caching:
            self._write_prompt(seq)
        super().release(seq)
        self.free(seq, publish=publish)

    def abort(self) -> None:
        """Forget the whole batch and give every block back."""
        for seq in self.live:
            self.free(seq)
        super().abort()
