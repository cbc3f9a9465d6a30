"""Prefill at request level: whole short prompts batched by prompt bucket, long prompts and
prefix-cache hits in chunks on a per-request staging cache, and the first token of each.

A prompt of at most ``chunk_tokens`` tokens with no cached prefix is prefilled whole, together
with the other such prompts of its prompt bucket (``prefill`` at (B, T), a cache of capacity
T; at most the step's token budget of padded tokens per call). Any other prompt is prefilled one chunk
per engine step (``chunk`` at (1, T, C)): its staging cache [1, Hkv, C, D] starts with the prefix
cache's blocks, if any, grows (by staging capacity bucket) as the prompt does, and each chunk
attends to what the cache holds so far, at offsets passed as arrays. Either way, once the
whole prompt is in, its first token is sampled, its cache row waits in ``seq.prefilled`` for a
decode slot (:meth:`DecodeBatch.join`) and its prompt waits in :meth:`Prefiller.take_saves` for
the engine to store its full blocks in the prefix cache once the step's first tokens are sent.
The prefiller holds no prefix cache: the engine starts a hit's staging cache from its blocks
(:meth:`Engine.match_prefix`) before the prefiller sees the request.

With a paged pool whose model prefills in blocks (:attr:`Executor.in_blocks`), the engine hands
the prefiller the block pool's bookkeeping (``blocks``) and there is no staging cache: every
call above (whole prompts, a chunk, last chunks together, a prefix hit's remainder) writes each
prompt's keys and values straight into the blocks the request took at admission
(:meth:`Executor.prefill_blocks`), at the same compile keys, a chunk's view of its blocks
taking the capacity its staging cache would have had; its ``seq.prefilled`` then holds an
:class:`InBlocks` marker, and nothing waits in :meth:`take_saves`. The full blocks each call
wrote are published (:meth:`BlockPool.mark_computed`) once the step's calls are read back, chunk
by chunk, not only when the request joins: a request deferred at admission because its prompt
shares them (:meth:`Engine._fits`) is admitted at the next step with a hit on them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from models.kv_cache import KVCache
from service.engine.block_pool import BlockPool
from service.engine.buckets import BucketTable
from service.engine.executor import Executor, InBlocks, rows_at_bucket
from service.engine.outputs import RunnerOutput
from service.engine.selector import TokenSelector, observe
from service.engine.sequence import Sequence
from service.metrics import StepStat


@dataclass
class _Pending:
    """A queued prefill call: its requests (none for a non-final chunk), their first tokens
    (int32 [B], lazy) and next PRNG keys, its cache (or, prefilled in blocks, the marker), and
    (phase, bucket, rows, bucket rows, start time) for its step stat."""

    group: list[Sequence]
    tokens: mx.array | None
    keys: list[mx.array | None]
    kv: KVCache | InBlocks
    stat: tuple
    logprobs: tuple | None = None
    kv_rows: list[int] | None = None  # the cache row of each request of ``group``


class Prefiller:
    """Prefill of the requests the scheduler admitted (same thread and compiled steps as decode).

    Args:
        executor: where the prefill steps run.
        selector: picks each prefilled request's first token.
        buckets: the bucket table (prompt, staging and batch buckets).
        chunk_tokens: prompt tokens one request prefills per step at most.
        whole_tokens: padded tokens one whole-prompt prefill call runs at most (the engine's
            per-step token budget): short prompts of one prompt bucket go together in as few
            calls as that allows.
    """

    def __init__(
        self,
        executor: Executor,
        selector: TokenSelector,
        buckets: BucketTable,
        chunk_tokens: int,
        whole_tokens: int = 2048,
    ):
        self.executor, self.selector, self.buckets = executor, selector, buckets
        self.chunk_tokens = chunk_tokens
        self.whole_tokens = max(whole_tokens, chunk_tokens)
        self.rows_cap = LAST_CHUNK_ROWS  # the warm-up lowers it to its warmed batch (see last_chunk_rows)
        self.blocks: BlockPool | None = None  # the pool's bookkeeping, where prompts prefill in blocks
        self._saves: list[tuple[list[tuple[list[int], int]], KVCache]] = []  # (prompts and rows, their cache)
        self._written: list[Sequence] = []  # requests whose blocks this step's calls write (in blocks)

    @property
    def in_blocks(self) -> bool:
        """Whether prompts are prefilled straight into their pool blocks (the engine handed over
        the block pool: :attr:`Executor.in_blocks`)."""
        return self.blocks is not None

    def take_saves(self) -> list[tuple[list[tuple[list[int], int]], KVCache]]:
        """The prompts prefilled since the last call, for the prefix cache: per prefill call,
        (each prompt's ids and its row, their cache), the arguments of
        :meth:`PrefixCache.insert_rows` (:meth:`Engine.save_prefixes`)."""
        saves, self._saves = self._saves, []
        return saves

    def run(self, seqs: list[Sequence]) -> RunnerOutput:
        """Advance each request's prompt by one chunk (or whole). Returns the first tokens of
        the requests whose prompt is now complete (their cache rows wait in ``seq.prefilled``
        for :meth:`DecodeBatch.join`; seeded rows' next keys in ``keys``), step stats and
        failures. Every call is queued first and the first tokens are read back together: one
        host sync for the whole step's prefill work. The prompts' blocks wait in
        :meth:`take_saves`, or, prefilled in blocks, the full blocks written are published once
        read back (none when the read-back fails)."""
        out = RunnerOutput()
        self._pending: list[_Pending] = []
        self._written = []
        whole: list[Sequence] = []
        finals: dict[tuple[int, int], list[Sequence]] = {}  # last chunks, by (chunk bucket T, staging C)
        for seq in seqs:
            try:
                if seq.num_computed == 0 and self._goes_whole(len(seq.prefill_ids)):
                    whole.append(seq)
                elif (last := self._last_chunk(seq)) is not None:
                    finals.setdefault(last, []).append(seq)
                else:
                    self._chunk(seq)
            except Exception as exc:  # one failed request must not take the others down
                self.executor.raise_if_fatal(exc)
                out.failed.append((seq, f"prefill failed: {type(exc).__name__}"))
        buckets, budget = self.buckets, self.whole_tokens
        groups = self._whole_groups(whole).items()
        calls = [(self._whole, p) for T, g in groups for p in _parts(g, buckets.prefill_rows(T, budget))]
        for (T, C), group in finals.items():
            rows = last_chunk_rows(buckets, T, budget, self.rows_cap, C)
            calls += [(self._chunks, group[i : i + rows]) for i in range(0, len(group), rows)]
        for call, part in calls:
            try:
                call(part)
            except Exception as exc:
                self.executor.raise_if_fatal(exc)
                out.failed += [(seq, f"prefill failed: {type(exc).__name__}") for seq in part]
        self._read_back(out)
        return out

    def _whole_groups(self, seqs: list[Sequence]) -> dict[int, list[Sequence]]:
        """Whole prompts grouped by the prompt bucket their calls are counted at: each prompt's
        own bucket; or, where an eager prefill runs at the prompts' own shape on a GPU (a gated
        delta loop in mlx-lm's ops, whose host work is per position whatever the rows), one
        group at the longest's bucket, shortest first: each call is one more pass of the loop,
        and mlx-lm's batched prefill also pads its prompts to the longest."""
        if seqs and self.executor.exact_prefill and self.executor.batches_chunks:
            group = sorted(seqs, key=lambda s: len(s.prefill_ids))
            return {self.buckets.prompt_for(len(group[-1].prefill_ids)): group}
        groups: dict[int, list[Sequence]] = {}
        for seq in seqs:
            groups.setdefault(self.buckets.prompt_for(len(seq.prefill_ids)), []).append(seq)
        return groups

    def _goes_whole(self, length: int) -> bool:
        """Whether a prompt of ``length`` tokens (none cached) is prefilled whole: at most
        ``chunk_tokens`` and, where the model's rows cannot be padded (``pads_prompts`` False),
        exactly a prompt bucket long (any other length goes in exact chunks, :func:`chunk_plan`)."""
        return length <= self.chunk_tokens and (self.executor.model.args.pads_prompts or length in self.buckets.prompt)

    def _last_chunk(self, seq: Sequence) -> tuple[int, int] | None:
        """(chunk bucket T, staging capacity C) when ``seq``'s next chunk is its prompt's last
        and the executor can run such chunks of several prompts in one call; else None."""
        if not self.executor.batches_chunks or self.rows_cap < 2:
            return None
        offset, n, T = self.chunk_plan(len(seq.prefill_ids), seq.num_computed)[0]
        if offset + n < len(seq.prefill_ids):
            return None
        return T, self.view_capacity(offset, T)

    def view_capacity(self, offset: int, T: int) -> int:
        """The capacity a chunk of bucket ``T`` at ``offset`` runs at: its staging cache's, or
        prefilled in blocks, the positions of its view of the row's blocks; the same bucket
        (:meth:`BucketTable.staging_for`), so warm-up covers both alike. In blocks a chunk starts
        at its position even where ``offset + T`` passes the largest capacity (its padding is
        written into the null block), at the largest staging capacity."""
        return self.buckets.staging_for(min(offset + T, self.buckets.capacity[-1]))

    def chunk_plan(self, length: int, start: int) -> list[tuple[int, int, int]]:
        """(offset, real tokens, bucket T) of each chunk that prefills positions start..length-1
        (:func:`chunk_plan`)."""
        args = self.executor.model.args  # a recurrent state cannot take a position twice
        return chunk_plan(
            self.buckets, self.chunk_tokens, length, start, args.has_states, args.pads_prompts, not self.in_blocks
        )

    def prefill(self, prompts: list[list[int]]) -> tuple[mx.array, KVCache]:
        """Prefill prompts together at bucket (batch_for(n), prompt_for(longest)) (:func:`pad_prompts`).

        Returns (logits float32 [B, V] at each prompt's last token, the prompts' KV cache
        [B, Hkv, T, D] per layer); rows >= n are padding. Where the executor prefills at the
        prompts' own shape (:attr:`Executor.exact_prefill`), the cache is [n, Hkv, longest, D]
        and the logits' rows n..B-1 repeat row 0 (the first tokens are sampled at the batch
        bucket, as warmed up).
        Raises BucketLimitError when the prompts do not fit a bucket.
        """
        rows, lengths = pad_prompts(self.buckets, prompts)
        if not self.executor.exact_prefill:
            return self.executor.prefill(rows, lengths)
        n, longest = len(prompts), max(lengths)
        bucket = (len(rows), len(rows[0]))
        logits, kv = self.executor.prefill([r[:longest] for r in rows[:n]], lengths[:n], bucket)
        return rows_at_bucket(logits, bucket[0]), kv

    def staging_capacity(self, length: int, start: int) -> int:
        """The staging capacity bucket that the first chunk of prefilling positions
        start..length-1 needs (a prefix-cache hit of ``start`` tokens is gathered at it)."""
        offset, _, T = self.chunk_plan(length, start)[0]
        return self.buckets.staging_for(offset + T)

    def next_chunk(self, seq: Sequence) -> tuple[KVCache, list[int], int, int]:
        """``seq``'s next chunk: (its staging cache at the capacity the chunk needs, the chunk's
        T tokens right-padded, its offset, its real tokens)."""
        offset, n, T = self.chunk_plan(len(seq.prefill_ids), seq.num_computed)[0]
        # The staging cache grows with the prompt (a chunk's attention costs its whole capacity).
        capacity = self.buckets.staging_for(offset + T)
        executor = self.executor
        kv: KVCache = executor.alloc(1, capacity) if seq.staging is None else seq.staging
        if kv.capacity < capacity:
            kv = executor.resize(kv, capacity, ring=False)  # linear: a chunk writes position p at index p
        return kv, seq.prefill_ids[offset : offset + n] + [0] * (T - n), offset, n

    def _chunk(self, seq: Sequence) -> None:
        """Prefill ``seq``'s next chunk (:meth:`next_chunk`) and, when it is a one-token chunk,
        the one-token chunks after it (a prompt's remainder in exact chunks, :func:`chunk_plan`),
        up to ``chunk_tokens`` tokens: one call each, all queued in this step. Samples the first
        token once the prompt is in."""
        if self.in_blocks:
            self._chunk_in_blocks(seq)
            return
        start = time.perf_counter()
        done = 0
        while True:
            kv, tokens, offset, n = self.next_chunk(seq)
            logits, kv = self.executor.chunk(kv, tokens, offset, n)
            seq.staging, seq.num_computed = kv, offset + n
            done += n
            if seq.prompt_done or len(tokens) > 1 or done >= self.chunk_tokens:
                break  # (after a one-token chunk, every chunk left is one)
        stat = ("chunk", f"b1x{len(tokens)}c{kv.capacity}", 1, 1, start)
        if seq.prompt_done:
            self._queue_first_tokens([seq], logits, kv, stat)
        else:
            mx.async_eval(kv.keys, kv.values, kv.states)
            self._pending.append(_Pending([], None, [], kv, stat))

    def _chunk_in_blocks(self, seq: Sequence) -> None:
        """:meth:`_chunk` straight into ``seq``'s blocks (:meth:`Executor.prefill_blocks` at
        (1, T, C)); a model that prefills in blocks pads its rows, so one chunk per step."""
        start = time.perf_counter()
        offset, n, T = self.chunk_plan(len(seq.prefill_ids), seq.num_computed)[0]
        capacity = self.view_capacity(offset, T)
        tokens = seq.prefill_ids[offset : offset + n] + [0] * (T - n)
        logits = self.executor.prefill_blocks([self._table(seq)], [tokens], [offset], [n], 1, capacity)
        seq.num_computed = offset + n
        self._written.append(seq)
        stat = ("chunk", f"b1x{T}c{capacity}", 1, 1, start)
        if seq.prompt_done:
            self._queue_first_tokens([seq], logits, InBlocks(), stat)
        else:
            mx.async_eval(logits)  # it depends on every layer's write into the blocks
            self._pending.append(_Pending([], None, [], InBlocks(), stat))

    def _table(self, seq: Sequence) -> list[int]:
        """``seq``'s blocks in position order (taken at admission, :meth:`Engine._fits`)."""
        assert self.blocks is not None
        return self.blocks.block_table(id(seq))

    def _chunks(self, group: list[Sequence]) -> None:
        """Prefill the last chunk of each prompt of ``group`` (one chunk bucket T, one staging
        capacity C) in one call at (batch bucket, T, C) (:meth:`Executor.chunk_rows`); a lone
        prompt takes the batch-1 path. Each samples its first token."""
        if len(group) == 1:
            self._chunk(group[0])
            return
        if self.in_blocks:
            self._chunks_in_blocks(group)
            return
        start = time.perf_counter()
        kvs, tokens, offsets, lengths = (list(part) for part in zip(*map(self.next_chunk, group), strict=True))
        B = last_chunk_rows(
            self.buckets,
            len(tokens[0]),
            self.whole_tokens,
            self.rows_cap,
            self.buckets.staging_for(offsets[0] + len(tokens[0])),
        )
        logits, kv = self.executor.chunk_rows(kvs, tokens, offsets, lengths, B)
        for seq in group:
            seq.staging, seq.num_computed = None, len(seq.prefill_ids)
        stat = ("chunk", f"b{B}x{len(tokens[0])}c{kv.capacity}", len(group), B, start)
        self._queue_first_tokens(group, logits, kv, stat)

    def _chunks_in_blocks(self, group: list[Sequence]) -> None:
        """:meth:`_chunks` straight into each request's blocks: one call at (B, T, C)."""
        start = time.perf_counter()
        plans = [self.chunk_plan(len(s.prefill_ids), s.num_computed)[0] for s in group]
        T = plans[0][2]
        capacity = self.view_capacity(plans[0][0], T)
        B = last_chunk_rows(self.buckets, T, self.whole_tokens, self.rows_cap, capacity)
        tokens = [s.prefill_ids[o : o + n] + [0] * (T - n) for s, (o, n, _) in zip(group, plans, strict=True)]
        offsets, lengths = [o for o, _, _ in plans], [n for _, n, _ in plans]
        logits = self.executor.prefill_blocks([self._table(s) for s in group], tokens, offsets, lengths, B, capacity)
        for seq in group:
            seq.num_computed = len(seq.prefill_ids)
        self._written += group
        stat = ("chunk", f"b{B}x{T}c{capacity}", len(group), B, start)
        self._queue_first_tokens(group, logits, InBlocks(), stat)

    def _whole(self, group: list[Sequence]) -> None:
        """Prefill ``group`` together; requests with the same prompt (the ``n`` choices of one
        request) share one row: one prefill, then each samples its own first token."""
        start = time.perf_counter()
        unique: dict[tuple[int, ...], int] = {}
        kv_rows = [unique.setdefault(tuple(s.prefill_ids), len(unique)) for s in group]
        if self.in_blocks:
            logits, kv, (B, T) = self._whole_in_blocks(group, kv_rows)
        else:
            logits, kv = self.prefill([list(p) for p in unique])
            B, T = logits.shape[0], self.buckets.prompt_for(max(len(p) for p in unique))  # the bucket's label
        if len(unique) < len(group):  # one logits row per request, padded to a batch bucket
            B = self.buckets.batch_for(len(group))
            logits = logits[mx.array(kv_rows + [0] * (B - len(group)), mx.int32)]
        for seq in group:
            seq.num_computed = len(seq.prefill_ids)
        stat = ("prefill", f"b{B}x{T}", len(unique), B, start)
        self._queue_first_tokens(group, logits, kv, stat, kv_rows)

    def _whole_in_blocks(self, group: list[Sequence], kv_rows: list[int]) -> tuple[mx.array, InBlocks, tuple]:
        """:meth:`_whole`'s prefill straight into the blocks of each row's first request (at
        (B, T), as ``prefill``): a later request of the same prompt gives back the blocks it
        took and shares the first one's (:meth:`BlockPool.fork`, before the step writes them;
        the first to write into their partial last block then copies it). Returns (logits
        [B, V], the marker, (B, T))."""
        blocks = self.blocks
        assert blocks is not None
        owners: dict[int, Sequence] = {}
        for seq, row in zip(group, kv_rows, strict=True):
            if (owner := owners.setdefault(row, seq)) is not seq:
                blocks.free(id(seq))
                blocks.fork(id(owner), id(seq))
        prompts = [owners[row].prefill_ids for row in range(len(owners))]
        tokens, lengths = pad_prompts(self.buckets, prompts)
        B, T, n = len(tokens), len(tokens[0]), len(prompts)
        tables = [self._table(owners[row]) for row in range(n)]
        logits = self.executor.prefill_blocks(tables, tokens[:n], [0] * n, lengths[:n], B)
        self._written += group
        return logits, InBlocks(), (B, T)

    def _publish_written(self) -> None:
        """Publish the full blocks this step's calls wrote into each request's blocks (prefilled
        in blocks; read back, so their keys and values are in the pool), for the prefix hits of
        the requests admitted next (:meth:`BlockPool.mark_computed`, idempotent: the join calls
        it again). A request cancelled or failed later leaves those blocks published: they hold
        what a step wrote and read back."""
        blocks, written, self._written = self.blocks, self._written, []
        if blocks is None:
            return
        for seq in written:
            if id(seq) in blocks:
                blocks.mark_computed(id(seq), seq.num_computed)

    def _queue_first_tokens(
        self,
        group: list[Sequence],
        logits: mx.array,
        kv: KVCache | InBlocks,
        stat: tuple,
        kv_rows: list[int] | None = None,
    ) -> None:
        """Queue the sampling of each prefilled request's first token from ``logits`` [B, V]
        (row i is ``group[i]``, whose keys and values are row ``kv_rows[i]`` of ``kv``; default i)."""
        rows: list[Sequence | None] = [*group, *[None] * (logits.shape[0] - len(group))]
        keys = [mx.random.key(s.params.seed) if s and s.params.seed is not None else None for s in rows]
        tokens, keys, lp = self.selector.select(logits, rows, keys)
        mx.async_eval(tokens, *(k for k in keys if k is not None), *(lp or ()))
        self._pending.append(_Pending(group, tokens, keys, kv, stat, lp, kv_rows or list(range(len(group)))))

    def _read_back(self, out: RunnerOutput) -> None:
        """Wait once for every queued call; then, for each prefilled request: its first
        token (and a seeded row's next key), its cache row parked for :meth:`DecodeBatch.join`
        and its prompt's blocks kept for :meth:`take_saves`."""
        pending, self._pending = self._pending, []
        caches = [p.kv.keys for p in pending if isinstance(p.kv, KVCache)]
        if len(caches) < len(pending) and (pool := self.executor.pool) is not None:
            caches.append([*pool.keys, *pool.values])  # prefilled in blocks: the pool they wrote
        try:
            self.executor.wait([p.tokens for p in pending if p.tokens is not None], caches)
        except Exception as exc:
            self.executor.raise_if_fatal(exc)
            out.failed += [(seq, f"prefill failed: {type(exc).__name__}") for p in pending for seq in p.group]
            return
        self._publish_written()
        done = time.perf_counter()
        for p in pending:
            phase, bucket, rows, bucket_rows, start = p.stat
            out.steps.append(StepStat(self.executor.model.name, phase, bucket, rows, bucket_rows, done - start))
            if p.tokens is None:
                continue
            token_list = self.executor.read(p.tokens)
            observe(list(p.group), token_list, p.logprobs)
            rows = [p.kv_rows[i] if p.kv_rows else i for i in range(len(p.group))]
            if isinstance(p.kv, KVCache):  # in blocks: the pool publishes them at join
                self._saves.append(([(seq.prefill_ids, row) for seq, row in zip(p.group, rows, strict=True)], p.kv))
            for i, (seq, row) in enumerate(zip(p.group, rows, strict=True)):
                seq.position = len(seq.prefill_ids)
                seq.prefilled, seq.staging = (p.kv, row), None
                if (key := p.keys[i]) is not None:
                    out.keys.append((seq, key))
                out.tokens.append((seq, token_list[i]))


LAST_CHUNK_ROWS = 8  # prompts whose last chunks one call runs at most
#: Staging positions one call running several prompts' last chunks holds at most (8 rows at 2,048):
#: the call copies each row's staging cache, so long prompts' last chunks run one by one.
LAST_CHUNK_POSITIONS = 16_384


def chunk_plan(
    buckets: BucketTable,
    chunk_tokens: int,
    length: int,
    start: int,
    exact: bool = False,
    padded: bool = True,
    shift: bool = True,
) -> list[tuple[int, int, int]]:
    """(offset, real tokens, bucket T) of each chunk of at most ``chunk_tokens`` tokens that
    prefills positions start..length-1 (``length`` at most the largest capacity bucket: the
    routes refuse longer prompts).

    Three ways, by what the model's rows allow:

    * attention only (neither flag): a chunk takes min(chunk_tokens, tokens left) tokens padded
      to their prompt bucket; one that would end past the largest capacity bucket starts
      earlier, recomputing a few positions it already holds (the same tokens at the same
      positions give the same keys and values); not with ``shift`` False (a prefill in pool
      blocks, whose padding past the table goes to the null block: a recomputed position could
      be a prefix hit's shared block);
    * ``exact`` (a recurrent state, which a position run twice would advance twice): a chunk
      starts where it should and takes the largest prompt bucket that still fits before the
      largest capacity bucket, fewer tokens if need be, or one token (T = 1) where none fits;
    * not ``padded`` (recurrent layers that ignore the padding of a row,
      :attr:`models.adapter.AdapterArgs.pads_prompts` False; exact too): every chunk is full,
      T = its real tokens: the largest prompt bucket within min(chunk_tokens, tokens left), and
      once fewer tokens than the smallest bucket are left, one token per chunk (T = 1).

    Raises:
        BucketLimitError: ``chunk_tokens`` exceeds the largest prompt bucket (a setting the
            configuration refuses).
    """
    plan, pos, limit = [], start, buckets.capacity[-1]
    while pos < length:
        n = min(chunk_tokens, length - pos)
        if not padded:
            T = n = max((b for b in buckets.prompt if b <= n), default=1)
            plan.append((pos, n, T))
            pos += n
            continue
        T = buckets.prompt_for(n)
        if exact and pos + T > limit:
            T = max((b for b in buckets.prompt if pos + b <= limit), default=1)
            n = min(n, T)
        offset = min(pos, limit - T) if shift else pos
        plan.append((offset, pos + n - offset, T))
        pos += n
    return plan


def pad_prompts(buckets: BucketTable, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """``prompts`` right-padded to bucket (batch_for(n), prompt_for(longest)): (B rows of T token
    ids, B real lengths; rows >= n are padding of length 1). Raises BucketLimitError when the
    prompts do not fit a bucket."""
    n = len(prompts)
    B = buckets.batch_for(n)
    T = buckets.prompt_for(max(len(p) for p in prompts))
    rows = [p + [0] * (T - len(p)) for p in prompts] + [[0] * T] * (B - n)
    return rows, [len(p) for p in prompts] + [1] * (B - n)


def last_chunk_rows(
    buckets: BucketTable, T: int, whole_tokens: int, rows_cap: int = LAST_CHUNK_ROWS, staging: int | None = None
) -> int:
    """The batch bucket that a call running several prompts' last chunks at chunk bucket ``T``
    is padded to (1: such chunks run one by one).

    One batch per chunk bucket, not one per row count: padding a few rows costs a little device
    work, while every (B, T, C) compiles a function (one more per chunk bucket and staging
    capacity, warmed before ready). It is the largest batch bucket within ``LAST_CHUNK_ROWS``,
    ``rows_cap`` (the warmed concurrency) and the step's token budget of padded tokens
    (``whole_tokens``, :meth:`BucketTable.prefill_rows`), and, at staging capacity ``staging``,
    within :data:`LAST_CHUNK_POSITIONS` staging positions.
    """
    most = min(LAST_CHUNK_ROWS, rows_cap, buckets.prefill_rows(T, whole_tokens))
    if staging is not None:
        most = min(most, LAST_CHUNK_POSITIONS // staging)
    return max(b for b in buckets.batch if b <= most or b == 1)


def _parts(group: list[Sequence], rows: int) -> list[list[Sequence]]:
    """``group`` cut into consecutive parts of at most ``rows`` distinct prompts each (requests
    with the same prompt share a row, :meth:`Prefiller._whole`)."""
    parts: list[list[Sequence]] = []
    seen: set[tuple[int, ...]] = set()
    for seq in group:
        key = tuple(seq.prefill_ids)
        if not parts or (key not in seen and len(seen) == rows):
            parts.append([])
            seen = set()
        parts[-1].append(seq)
        seen.add(key)
    return parts
