"""The KV block pool's host side: which device blocks each sequence's tokens live in.

The device holds, per layer, one keys and one values array of ``num_blocks`` blocks of
``block_tokens`` positions (:mod:`models.paged`); this module only decides block ids. A
sequence's *block table* lists its blocks in position order: position p of the sequence is
offset ``p % block_tokens`` of block ``table[p // block_tokens]``. Running sequences and the
prefix cache share the one pool: a prefix hit references cached blocks instead of copying them.

The policy is vLLM's (v1 ``BlockPool`` and ``KVCacheManager``, and its "Automatic Prefix
Caching" design doc) as nano-vllm's ``BlockManager`` states it in a few dozen lines:

- Every block has a reference count: the number of sequences whose table holds it.
- A *full* block whose keys and values are written (:meth:`BlockPool.mark_computed`) is
  *published* under a digest chained over the prefix it ends: ``digest_i = hash(digest_{i-1},
  tokens of block i)``, so one digest names the whole prefix ``tokens[: (i + 1) *
  block_tokens]`` (a block's keys and values depend on every earlier token through attention and
  on their positions through RoPE). A new sequence's leading full blocks are looked up by digest
  (a *prefix hit*); each hit also compares the block's tokens and its parent digest, so a hash
  collision costs a miss, never a wrong prefix.
- An unreferenced published block is *cached*: it sits in an LRU and can still be hit. An
  unreferenced unpublished block is *free*. A new block comes from the free list first, then by
  evicting the least recently used cached block; a request is refused only when both are empty.
  A freed sequence's blocks enter the LRU tail first, so a chain is evicted from its tail and a
  cached child is rarely left behind its evicted parent (vLLM frees in reverse order for this).
- A sequence writes only blocks it alone holds: before it writes into a shared partial last
  block (after :meth:`BlockPool.fork`, or a truncation into a block others hit) it gets a copy,
  and :meth:`BlockPool.append_slots` returns the ``(src, dst)`` block copy the device must do
  first (copy-on-write, vLLM v0's ``BlockSpaceManager``).
- A sequence's prompt blocks that are not published yet are *pending* from its allocation until
  they are published (or the sequence is freed or truncated before them): their chain digests are
  known from its tokens, so :meth:`BlockPool.pending` tells a waiting prompt that the blocks it
  would compute are on their way in another sequence (the engine then defers its admission,
  :meth:`service.engine.core.Engine._fits`, rather than compute and hold them twice).
- Block 0 is the *null block* (vLLM v1's ``null_block``): never allocated, it is what padded
  rows and table columns beyond a row's blocks point at, so a padded token's write lands there
  and nowhere else; attention masks whatever it holds.

Units: tokens and blocks are counts; a block holds ``block_tokens`` token positions. Pure
Python: no MLX here. The engine thread is the only caller, so nothing takes a lock.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

#: ``(parent digest, a block's token ids) -> digest``.
HashFn = Callable[[bytes, Sequence[int]], bytes]
#: The parent digest of a sequence's first block.
ROOT_DIGEST = b""
#: The block id that padding points at; never allocated to a sequence.
NULL_BLOCK = 0


def sha256_block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """sha256 over the parent digest and the tokens as native int64: the prefix cache's digest
    (:mod:`service.engine.prefix_cache`), so the two name the same prefix alike. Not Python's
    ``hash``: ints hash to themselves modulo 2**61 - 1, so a client could forge collisions."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class NoFreeBlocks(RuntimeError):
    """The pool has too few free and cached blocks for the request; nothing was changed."""


class PoolInvariantError(RuntimeError):
    """:meth:`BlockPool.check` found the pool's bookkeeping inconsistent (a bug)."""


class BlockCopy(NamedTuple):
    """A copy-on-write the device must do before the step that writes the sequence: every
    layer's keys and values of block ``src`` copied into block ``dst``."""

    src: int
    dst: int


@dataclass(frozen=True)
class Allocation:
    """What :meth:`BlockPool.allocate` gave a sequence.

    Attributes:
        block_table: block ids, one per ``block_tokens`` positions of the prompt, in order.
        num_cached_tokens: leading prompt tokens whose keys and values the hit blocks already
            hold (a multiple of ``block_tokens``): prefill starts at this position.
    """

    block_table: tuple[int, ...]
    num_cached_tokens: int


@dataclass(frozen=True)
class PoolStats:
    """Block counts for metrics; ``used + cached + free == total``.

    Attributes:
        total: blocks a sequence can get (the pool's blocks less the null block).
        used: blocks some sequence holds (reference count > 0).
        cached: unreferenced published blocks (the prefix cache's LRU; evictable).
        free: unreferenced unpublished blocks.
    """

    total: int
    used: int
    cached: int
    free: int


class _Owner(NamedTuple):
    """A pending digest's sequence and the index of its block in that sequence's table."""

    seq_id: Hashable
    index: int


@dataclass(eq=False, slots=True)
class _Block:
    refs: int = 0
    digest: bytes | None = None  # set while published (then the pool's index maps it here)
    parent: bytes = ROOT_DIGEST  # the digest before it, while published
    tokens: tuple[int, ...] = ()  # its tokens, while published


@dataclass(eq=False, slots=True)
class _Sequence:
    tokens: list[int]
    table: list[int]
    digests: list[bytes] = field(default_factory=list)  # chain digests of its computed full blocks
    pending: set[bytes] = field(default_factory=set)  # digests it owns in the pool's pending map


class BlockPool:
    """Block tables, reference counts and the prefix cache's LRU over ``num_blocks`` blocks.

    Args:
        num_blocks: blocks in the device pool, the null block included (>= 2).
        block_tokens: token positions per block (>= 1; 16 to 64 is usual: smaller blocks hit
            more often and waste less of a last block, larger ones cost fewer table entries).
        hash_fn: the block digest; :func:`sha256_block_hash` by default (tests inject colliding
            ones).
        caching: whether blocks are published for prefix hits at all (False: no prefix
            caching; :meth:`allocate` hits nothing and counts nothing, :meth:`mark_computed`
            publishes nothing, a freed block is free at once).

    Raises:
        ValueError: ``num_blocks`` < 2 or ``block_tokens`` < 1.

    Sequences are named by any hashable id. Counters (monotonic, for metrics): ``queried_tokens``
    (prompt tokens looked up by :meth:`allocate`), ``hit_tokens`` (of those, found cached),
    ``evicted_blocks``.
    """

    def __init__(self, num_blocks: int, block_tokens: int, hash_fn: HashFn = sha256_block_hash, caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs num_blocks >= 2 (one is the null block), got {num_blocks}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.num_blocks, self.block_tokens = num_blocks, block_tokens
        self.caching = caching
        self._hash = hash_fn
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: deque[int] = deque(range(1, num_blocks))  # block 0 is the null block
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently used first
        self._published: dict[bytes, int] = {}  # digest -> block id
        self._pending: dict[bytes, _Owner] = {}  # digest -> the sequence computing it (never published)
        self._seqs: dict[Hashable, _Sequence] = {}
        self.queried_tokens = self.hit_tokens = self.evicted_blocks = 0

    # -- sizes and counts --------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` positions: ceil(num_tokens / block_tokens)."""
        return -(-num_tokens // self.block_tokens)

    def stats(self) -> PoolStats:
        """The pool's block counts now."""
        free, cached = len(self._free), len(self._lru)
        total = self.num_blocks - 1
        return PoolStats(total=total, used=total - free - cached, cached=cached, free=free)

    @property
    def num_available(self) -> int:
        """Blocks a new allocation can take: free plus cached (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Cached blocks: published, held by no sequence (evictable, and still hit)."""
        return len(self._lru)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table. Raises KeyError for an unknown sequence."""
        return list(self._seqs[seq_id].table)

    def exclusive(self, block_id: int) -> bool:
        """Whether block ``block_id`` is held by one block table alone and not published: a step
        may write it without another sequence or a later prefix hit reading what it wrote."""
        block = self._blocks[block_id]
        return block_id != NULL_BLOCK and block.refs == 1 and block.digest is None

    def num_tokens(self, seq_id: Hashable) -> int:
        """Token positions the sequence holds slots for. Raises KeyError for an unknown one."""
        return len(self._seqs[seq_id].tokens)

    def num_computed(self, seq_id: Hashable) -> int:
        """Leading tokens of the sequence in full blocks counted computed: right after
        :meth:`allocate` the prefix hit's tokens (what prefill may skip), then up to the last
        full block :meth:`mark_computed` reached (a multiple of ``block_tokens``; always 0 without
        ``caching``). Raises KeyError for an unknown sequence."""
        return len(self._seqs[seq_id].digests) * self.block_tokens

    # -- admission and allocation ------------------------------------------------------------

    def _match(self, tokens: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The published blocks ``tokens`` starts with and their digests, capped to leave at least
        one token to compute (the last prompt token's logits are needed, as vLLM v1 caps its
        hit at ``num_tokens - 1``): at most ``(len(tokens) - 1) // block_tokens`` blocks."""
        bt, hits, digests, digest = self.block_tokens, [], [], ROOT_DIGEST
        for i in range((len(tokens) - 1) // bt if self.caching else 0):
            chunk = tuple(tokens[i * bt : (i + 1) * bt])
            parent, digest = digest, self._hash(digest, chunk)
            block_id = self._published.get(digest)
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.tokens != chunk or block.parent != parent:
                break  # a collision with another prefix
            hits.append(block_id)
            digests.append(digest)
        return hits, digests

    def _needed(self, tokens: Sequence[int]) -> tuple[int, int, int]:
        """(new blocks an allocation of ``tokens`` takes, blocks it hits, of those the cached
        ones, which leave the evictable set when hit)."""
        hits, _ = self._match(tokens)
        in_lru = sum(1 for b in hits if self._blocks[b].refs == 0)
        return self.blocks_for(len(tokens)) - len(hits), len(hits), in_lru

    def peek(self, tokens: Sequence[int]) -> int:
        """The prompt tokens :meth:`allocate` of ``tokens`` would find cached now (a multiple of
        ``block_tokens``), without taking, marking or counting anything (for the scheduler's
        token budget)."""
        return len(self._match(tokens)[0]) * self.block_tokens

    def pending(self, tokens: Sequence[int], seq_id: Hashable | None = None) -> int:
        """How many of the full blocks ``tokens`` would hit, right after its published ones, are
        pending in a sequence other than ``seq_id``: computed by it now, and published once they
        are written (:meth:`mark_computed`). Only blocks :meth:`allocate` could hit are counted
        (at most ``(len(tokens) - 1) // block_tokens`` blocks in all), consecutive from the
        first unpublished one; each is checked against its owner's tokens, so a hash collision
        counts nothing. 0 without ``caching``. Changes nothing."""
        bt, (hits, digests) = self.block_tokens, self._match(tokens)
        digest, count = digests[-1] if digests else ROOT_DIGEST, 0
        for i in range(len(hits), (len(tokens) - 1) // bt if self._pending else 0):
            chunk = tuple(tokens[i * bt : (i + 1) * bt])
            digest = self._hash(digest, chunk)
            owner = self._pending.get(digest)
            if owner is None or owner.seq_id == seq_id or owner.index != i:
                break
            if tuple(self._seqs[owner.seq_id].tokens[i * bt : (i + 1) * bt]) != chunk:
                break  # a collision with another prefix
            count += 1
        return count

    def can_allocate(self, tokens: Sequence[int], reserve: int = 0) -> bool:
        """Whether :meth:`allocate` of ``tokens`` would succeed leaving ``reserve`` blocks (>= 0)
        available: the blocks not already cached, plus the reserve, against free plus
        evictable blocks (vLLM v1's admission by blocks). Changes nothing."""
        new, _, in_lru = self._needed(tokens)
        return new + reserve <= self.num_available - in_lru

    def allocate(self, seq_id: Hashable, tokens: Sequence[int], reserve: int = 0) -> Allocation:
        """Give a new sequence slots for its prompt ``tokens``, reusing cached prefix blocks.

        Each hit block's reference count goes up (a cached one leaves the LRU); every other
        block is new (free first, else the least recently used cached block is evicted).
        ``reserve``: blocks (>= 0) that must stay available after it (:meth:`can_allocate`).
        The prompt's full blocks after the hit that are neither published nor pending in another
        sequence become pending in this one (:meth:`pending`) until :meth:`mark_computed`
        publishes them or :meth:`free` or :meth:`truncate` drops them.

        Raises:
            ValueError: the sequence exists already, or ``tokens`` is empty.
            NoFreeBlocks: too few free and cached blocks (nothing changed).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if not tokens:
            raise ValueError("a sequence needs at least one token")
        hits, digests = self._match(tokens)
        new = self.blocks_for(len(tokens)) - len(hits)
        in_lru = sum(1 for b in hits if self._blocks[b].refs == 0)
        if new + reserve > self.num_available - in_lru:
            raise NoFreeBlocks(
                f"{new} new blocks (and {reserve} in reserve) needed, {self.num_available - in_lru} available"
            )
        for block_id in hits:
            self._ref(block_id)
        table = hits + [self._take() for _ in range(new)]
        self._seqs[seq_id] = seq = _Sequence(list(tokens), table, digests)
        if self.caching:
            self.queried_tokens += len(tokens)
            self.hit_tokens += len(hits) * self.block_tokens
            self._add_pending(seq_id, seq)
        return Allocation(tuple(table), len(hits) * self.block_tokens)

    def _add_pending(self, seq_id: Hashable, seq: _Sequence) -> None:
        """Record ``seq``'s uncomputed full blocks as pending in it, those not published and not
        pending in another sequence already."""
        bt, digest = self.block_tokens, seq.digests[-1] if seq.digests else ROOT_DIGEST
        for i in range(len(seq.digests), len(seq.tokens) // bt):
            digest = self._hash(digest, seq.tokens[i * bt : (i + 1) * bt])
            if digest not in self._published and digest not in self._pending:
                self._pending[digest] = _Owner(seq_id, i)
                seq.pending.add(digest)

    def _drop_pending(self, seq: _Sequence, start: int = 0) -> None:
        """Forget the pending blocks ``seq`` owns from its block ``start`` on."""
        for digest in [d for d in seq.pending if self._pending[d].index >= start]:
            del self._pending[digest]
            seq.pending.discard(digest)

    def _ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.refs == 0:
            del self._lru[block_id]
        block.refs += 1

    def _take(self) -> int:
        """A new block with one reference: a free one, else the LRU's oldest, evicted."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._lru.popitem(last=False)
            self._unpublish(block_id)
            self.evicted_blocks += 1
        self._blocks[block_id].refs = 1
        return block_id

    def _unpublish(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.digest is not None:
            del self._published[block.digest]
        block.digest, block.parent, block.tokens = None, ROOT_DIGEST, ()

    # -- growth --------------------------------------------------------------------------------

    def _append_cost(self, seq: _Sequence, num_new: int) -> tuple[int, bool]:
        """(new blocks appending ``num_new`` tokens takes, whether its last block is copied)."""
        n, bt = len(seq.tokens), self.block_tokens
        cow = n % bt != 0 and num_new > 0 and self._blocks[seq.table[-1]].refs > 1
        return self.blocks_for(n + num_new) - len(seq.table) + cow, cow

    def append_cost(self, seq_id: Hashable, num_new: int) -> int:
        """New blocks :meth:`append_slots` of ``num_new`` tokens would take now, a copy-on-write
        of a shared partial last block included. Raises KeyError for an unknown sequence."""
        return self._append_cost(self._seqs[seq_id], num_new)[0]

    def can_append(self, seq_id: Hashable, num_new: int) -> bool:
        """Whether :meth:`append_slots` of ``num_new`` tokens would succeed. Changes nothing."""
        return self._append_cost(self._seqs[seq_id], num_new)[0] <= self.num_available

    def append_slots(self, seq_id: Hashable, tokens: Sequence[int]) -> list[BlockCopy]:
        """Slots for ``tokens`` appended to a sequence (decode: one token; speculative verify:
        several), at positions ``num_tokens .. num_tokens + len(tokens) - 1``.

        A new block is taken at each block boundary. When the first new position falls in a
        partial last block that another sequence also holds, that block is replaced in this
        table by a copy (copy-on-write); a partial last block this sequence alone holds but that
        is still published (a truncation into a full block) is unpublished, since it is about to
        be overwritten.

        Returns:
            The block copies the device must do before the step that writes these tokens
            (at most one).

        Raises:
            KeyError: unknown sequence.
            NoFreeBlocks: too few free and cached blocks (nothing changed).
        """
        seq = self._seqs[seq_id]
        need, cow = self._append_cost(seq, len(tokens))
        if need > self.num_available:
            raise NoFreeBlocks(f"{need} new blocks needed, {self.num_available} available")
        copies = []
        if cow:
            src = seq.table[-1]
            dst = self._take()
            self._blocks[src].refs -= 1  # still > 0: another sequence holds it
            seq.table[-1] = dst
            copies.append(BlockCopy(src, dst))
        elif len(seq.tokens) % self.block_tokens and tokens and self._blocks[seq.table[-1]].digest is not None:
            self._unpublish(seq.table[-1])
        seq.tokens.extend(tokens)
        seq.table.extend(self._take() for _ in range(self.blocks_for(len(seq.tokens)) - len(seq.table)))
        return copies

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """The keys and values of the sequence's first ``num_tokens`` tokens are written: its
        full blocks among them are published for prefix hits (each under its chain digest; a
        block whose prefix another block already publishes stays unpublished, as vLLM v1 leaves
        duplicates uncached). Idempotent; call it once the step that writes them has run (or
        is the step that reads them: a paged step writes every row's keys before any row reads).
        The blocks it computes are no longer pending (:meth:`pending`), nor, once published, are
        those of the same prefix pending in another sequence.

        Raises:
            KeyError: unknown sequence.
            ValueError: ``num_tokens`` exceeds the sequence's tokens.
        """
        seq, bt = self._seqs[seq_id], self.block_tokens
        if num_tokens > len(seq.tokens):
            raise ValueError(f"{num_tokens} tokens computed, but the sequence has {len(seq.tokens)}")
        for i in range(len(seq.digests), num_tokens // bt if self.caching else 0):
            chunk = tuple(seq.tokens[i * bt : (i + 1) * bt])
            parent = seq.digests[-1] if seq.digests else ROOT_DIGEST
            digest = self._hash(parent, chunk)
            seq.digests.append(digest)
            block = self._blocks[seq.table[i]]
            if digest not in self._published and block.digest is None:
                block.digest, block.parent, block.tokens = digest, parent, chunk
                self._published[digest] = seq.table[i]
            owner = self._pending.get(digest)
            if owner is not None and (owner.seq_id == seq_id or digest in self._published):
                del self._pending[digest]  # computed, or published by another sequence first
                self._seqs[owner.seq_id].pending.discard(digest)

    def set_tokens(self, seq_id: Hashable, start: int, tokens: Sequence[int]) -> None:
        """Name the tokens at positions ``start .. start + len(tokens) - 1`` of the sequence:
        :meth:`append_slots` may take slots before their tokens are known (a decode step's
        next positions), and :meth:`mark_computed` digests a block by its tokens.

        Raises:
            KeyError: unknown sequence.
            ValueError: the positions reach past the sequence's slots, or into a block already
                counted computed (its digest was taken over its tokens then).
        """
        seq = self._seqs[seq_id]
        if start < len(seq.digests) * self.block_tokens or start + len(tokens) > len(seq.tokens):
            raise ValueError(
                f"positions {start}..{start + len(tokens) - 1}: the sequence has {len(seq.tokens)} slots and its "
                f"first {len(seq.digests) * self.block_tokens} tokens are computed"
            )
        if seq.pending and list(tokens) != seq.tokens[start : start + len(tokens)]:
            self._drop_pending(seq, start // self.block_tokens)  # digested under the old tokens
        seq.tokens[start : start + len(tokens)] = tokens

    # -- sharing and release ------------------------------------------------------------------

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """A new sequence ``child_id`` sharing every block of ``parent_id`` (parallel sampling
        of one prompt): reference counts go up, no block is taken. The first of the two to write
        into their shared partial last block gets a copy (:meth:`append_slots`).

        Raises:
            KeyError: unknown parent. ValueError: the child exists already.
        """
        parent = self._seqs[parent_id]
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already holds blocks")
        for block_id in parent.table:
            self._blocks[block_id].refs += 1
        self._seqs[child_id] = _Sequence(list(parent.tokens), list(parent.table), list(parent.digests))

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the sequence's first ``num_tokens`` tokens (rejected speculative tokens):
        blocks past them are released as by :meth:`free`, and its pending full blocks past them
        are pending no more.

        Raises:
            KeyError: unknown sequence. ValueError: ``num_tokens`` < 1 or above its tokens.
        """
        seq = self._seqs[seq_id]
        if not 1 <= num_tokens <= len(seq.tokens):
            raise ValueError(f"cannot truncate a sequence of {len(seq.tokens)} tokens to {num_tokens}")
        keep = self.blocks_for(num_tokens)
        self._drop_pending(seq, num_tokens // self.block_tokens)
        self._release(seq.table[keep:])
        del seq.table[keep:], seq.tokens[num_tokens:], seq.digests[num_tokens // self.block_tokens :]

    def free(self, seq_id: Hashable) -> None:
        """Release a finished, cancelled or preempted sequence's blocks: each loses a reference;
        one left unreferenced is cached (published) or free. Its blocks enter the LRU last block
        first, so its tail is evicted before its head; its pending blocks are pending no more
        (a prompt waiting for them computes them itself). Raises KeyError for an unknown one."""
        seq = self._seqs.pop(seq_id)
        self._drop_pending(seq)
        self._release(seq.table)

    def evict_cached(self) -> int:
        """Evict every cached (unreferenced, published) block: they become free and no longer
        hit. Returns the blocks evicted (counted in ``evicted_blocks``)."""
        evicted = len(self._lru)
        while self._lru:
            block_id, _ = self._lru.popitem(last=False)
            self._unpublish(block_id)
            self._free.append(block_id)
        self.evicted_blocks += evicted
        return evicted

    def _release(self, table: list[int]) -> None:
        for block_id in reversed(table):
            block = self._blocks[block_id]
            block.refs -= 1
            if block.refs == 0:
                if block.digest is not None:
                    self._lru[block_id] = None
                else:
                    self._free.append(block_id)

    # -- consistency ---------------------------------------------------------------------------

    def check(self) -> None:
        """Verify the bookkeeping: every block but the null block is exactly one of free, cached
        (in the LRU) or referenced; each reference count equals the number of block tables
        holding the block; cached blocks are published and free ones are not; the digest index
        and the blocks agree; every table has one block per ``block_tokens`` of its tokens; every
        pending digest is unpublished and names an uncomputed full block of a live sequence (its
        chain digest over that sequence's tokens), and the map and the sequences' own sets agree.

        Raises:
            PoolInvariantError: the first inconsistency found.
        """
        holders = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            _require(len(seq.table) == self.blocks_for(len(seq.tokens)), f"{seq_id!r}: table size != its tokens")
            _require(len(set(seq.table)) == len(seq.table), f"{seq_id!r}: a block twice in one table")
            for block_id in seq.table:
                holders[block_id] += 1
        free, lru = set(self._free), set(self._lru)
        _require(len(free) == len(self._free), "a block twice in the free list")
        _require(NULL_BLOCK not in free | lru and holders[NULL_BLOCK] == 0, "the null block was handed out")
        for block_id in range(1, self.num_blocks):
            block = self._blocks[block_id]
            _require(block.refs == holders[block_id], f"block {block_id}: refs {block.refs} != {holders[block_id]}")
            states = (block_id in free, block_id in lru, block.refs > 0)
            _require(sum(states) == 1, f"block {block_id}: free/cached/referenced = {states}")
            _require(block_id not in lru or block.digest is not None, f"cached block {block_id} is not published")
            _require(block_id not in free or block.digest is None, f"free block {block_id} is published")
            if block.digest is not None:
                _require(self._published.get(block.digest) == block_id, f"block {block_id}: digest not indexed")
        _require(all(self._blocks[b].digest == d for d, b in self._published.items()), "a stale digest index entry")
        self._check_pending()

    def _check_pending(self) -> None:
        """:meth:`check`'s part for the pending map."""
        bt, chains = self.block_tokens, {}
        for digest, (seq_id, i) in self._pending.items():
            seq = self._seqs.get(seq_id)
            _require(seq is not None and digest in seq.pending, f"pending block of {seq_id!r} not its own")
            assert seq is not None
            _require(len(seq.digests) <= i < len(seq.tokens) // bt, f"{seq_id!r}: block {i} is not pending")
            _require(digest not in self._published, f"{seq_id!r}: pending block {i} is published")
            if seq_id not in chains:
                chain, parent = [], ROOT_DIGEST
                for j in range(len(seq.tokens) // bt):
                    parent = self._hash(parent, seq.tokens[j * bt : (j + 1) * bt])
                    chain.append(parent)
                chains[seq_id] = chain
            _require(chains[seq_id][i] == digest, f"{seq_id!r}: pending block {i} under another digest")
        owned = sum(len(seq.pending) for seq in self._seqs.values())
        _require(owned == len(self._pending), "a sequence owns a pending digest the map lost")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise PoolInvariantError(message)
