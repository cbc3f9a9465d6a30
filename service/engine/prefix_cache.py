"""The prefix cache: KV of prompt prefixes kept in fixed-size token blocks, chained by hash.

The scheme is vLLM's automatic prefix caching (docs.vllm.ai, "Automatic Prefix Caching" design
doc): a prompt is cut into full blocks of ``block_tokens`` tokens; block i's digest covers its
parent's digest and its own tokens, so one digest names the whole prefix ``tokens[: (i+1) *
block_tokens]`` and a block's keys and values (which depend on every earlier token through
attention and on their positions through RoPE) are reused only after that same prefix. The key
is the tokens alone: sampling settings do not change a prompt's KV, so requests and chats that
share a system prompt share its blocks. One cache serves one model at one KV dtype.

A digest is only an index: every hit also compares the stored block's tokens and its parent
(the block object matched just before), so a hash collision costs a miss, never a wrong prefix.

Memory: blocks sit in an LRU ordered so that a block is always *less* recently used than its
parent (a hit or an insert touches a chain from its deepest block up to its first). The least
recently used block therefore never has a cached child: eviction takes leaves first, a chain
shrinks from its tail, and no cached block is ever orphaned (vLLM evicts a freed request's
blocks tail first for the same reason). ``nbytes`` counts the blocks' MLX arrays only (the
tokens and Python objects are small beside them) and never exceeds ``budget_bytes`` after an
insert.

Threading: the engine thread is the only caller (it is the one thread that touches MLX), so
nothing here takes a lock.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from models.kv_cache import KVCache
from service.engine.kv_blocks import copy_blocks, join_blocks
from service.metrics import PrefixCacheStat

HashFn = Callable[[bytes, Sequence[int]], bytes]
ROOT_DIGEST = b""  # the parent digest of a prompt's first block
_EMPTY = mx.zeros((0,))  # a new block's kv until its copy is made


def sha256_block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The default block digest: sha256 over the parent's digest and the tokens as native int64.

    sha256 rather than Python's ``hash`` of a tuple: ints hash to themselves modulo 2**61 - 1,
    so a client could forge colliding prompts at will; a collision is caught by the token
    comparison anyway, but would shadow another prompt's blocks (that prompt stops hitting).
    """
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


@dataclass(eq=False)
class Block:
    """One cached block: ``block_tokens`` prompt tokens and their keys and values.

    Attributes:
        digest: the chained hash of the prefix ending with this block (the LRU's key).
        parent: the block before it in the prompt (None for a prompt's first block).
        tokens: its token ids.
        kv: [layers, 2 (keys, values), Hkv, block_tokens, D] in the cache's dtype: one array
            per block, so gathering a hit copies one array per block rather than one per
            layer and block (on a GPU, each copy is a kernel launch); a copy (evaluated
            asynchronously) that shares no buffer with the cache it came from.
        nbytes: bytes of ``kv``.
    """

    digest: bytes
    parent: Block | None
    tokens: tuple[int, ...]
    kv: mx.array
    nbytes: int

    @property
    def keys(self) -> list[mx.array]:
        """Per layer, the block's keys [Hkv, block_tokens, D] (views of ``kv``)."""
        return [self.kv[layer, 0] for layer in range(self.kv.shape[0])]

    @property
    def values(self) -> list[mx.array]:
        """Per layer, the block's values [Hkv, block_tokens, D] (views of ``kv``)."""
        return [self.kv[layer, 1] for layer in range(self.kv.shape[0])]


@dataclass(frozen=True)
class PrefixHit:
    """The cached blocks a prompt starts with, in prompt order.

    The hit holds its blocks' arrays, so it stays valid (``gather`` still returns the right
    keys and values) even if the blocks are evicted before it is gathered; their memory returns
    once the hit is dropped as well.
    """

    num_tokens: int  # len(blocks) * block_tokens: the prompt positions the hit covers
    blocks: tuple[Block, ...]


class PrefixCache:
    """Blocks of prompt KV keyed by chained digest, in an LRU bounded by ``budget_bytes``.

    Args:
        block_tokens: tokens per block (> 0). Smaller blocks hit more often (a prefix is cached
            up to its last full block) and cost more hashing and copies per token.
        budget_bytes: the most bytes of keys and values held (>= 0); 0 disables the cache
            (``match`` hits nothing and counts nothing, ``insert`` stores nothing).
        hash_fn: ``(parent digest, block tokens) -> digest``; the default is
            :func:`sha256_block_hash` (tests inject colliding ones).
        ops: where blocks are copied and gathered (:class:`BlockOps`); the default is this
            process's arrays, and the engine's runner sets its executor (a pipeline group's
            ranks then each hold their own layers' blocks, rank 0's LRU deciding for all).

    Raises:
        ValueError: ``block_tokens`` < 1 or ``budget_bytes`` < 0.

    Counters (monotonic, for metrics): ``queried_tokens`` (prompt tokens looked up),
    ``hit_tokens`` (of those, tokens found cached), ``evicted_blocks``.
    """

    def __init__(
        self, block_tokens: int, budget_bytes: int, hash_fn: HashFn = sha256_block_hash, ops: BlockOps | None = None
    ):
        if block_tokens < 1:
            raise ValueError(f"prefix cache block_tokens must be >= 1, got {block_tokens}")
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget_bytes must be >= 0 (0 disables it), got {budget_bytes}")
        self.block_tokens = block_tokens
        self.budget_bytes = budget_bytes
        self._hash = hash_fn
        self.ops: BlockOps = ops or LOCAL_BLOCKS
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self._nbytes = 0
        self._layout: tuple[int, int, int, mx.Dtype] | None = None  # layers, Hkv, D, dtype
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0
        self._reported = (0, 0, 0)  # the counters at the previous take_stat

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values held by cached blocks."""
        return self._nbytes

    def __len__(self) -> int:
        """Cached blocks."""
        return len(self._blocks)

    def match(self, tokens: Sequence[int]) -> PrefixHit:
        """The longest run of cached full blocks ``tokens`` starts with, marked most recently used.

        The hit is capped to leave at least one prompt token to prefill (the engine needs the
        last prompt token's logits): a prompt of n tokens hits at most ``(n - 1) //
        block_tokens`` blocks. Each block found by digest must also hold the prompt's tokens
        and follow the block matched before it, or the walk stops there. Counts ``len(tokens)``
        queried and ``num_tokens`` hit (nothing when the cache is disabled).
        """
        if self.budget_bytes == 0:
            return PrefixHit(0, ())
        B = self.block_tokens
        blocks = self._chain(tokens)
        self._touch(blocks)
        hit = PrefixHit(len(blocks) * B, tuple(blocks))
        self.queried_tokens += len(tokens)
        self.hit_tokens += hit.num_tokens
        return hit

    def peek(self, tokens: Sequence[int]) -> int:
        """The tokens :meth:`match` would hit now, without marking or counting anything (for
        the scheduler's token budget)."""
        return len(self._chain(tokens)) * self.block_tokens if self.budget_bytes else 0

    def _chain(self, tokens: Sequence[int]) -> list[Block]:
        """The cached blocks ``tokens`` starts with (capped to leave one token), each checked
        against its parent and its tokens."""
        B, blocks = self.block_tokens, []
        parent, digest = None, ROOT_DIGEST
        for i in range((len(tokens) - 1) // B):
            chunk = tuple(tokens[i * B : (i + 1) * B])
            digest = self._hash(digest, chunk)
            block = self._blocks.get(digest)
            if block is None or block.parent is not parent or block.tokens != chunk:
                break  # a miss, or a collision with another prefix
            blocks.append(block)
            parent = block
        return blocks

    def gather(self, hit: PrefixHit, capacity: int | None = None) -> KVCache:
        """The hit's keys and values as a batch-1 cache of capacity ``hit.num_tokens``.

        Returns per layer [1, Hkv, capacity or hit.num_tokens, D] in the cache's dtype (lazy:
        the blocks concatenated along the position axis, zero-padded up to ``capacity``).
        Positions ``[0, hit.num_tokens)`` of a prompt's cache row are exactly these; prefill
        the rest starting at ``hit.num_tokens``.

        Raises:
            ValueError: the hit is empty (check ``hit.num_tokens`` first).
        """
        if not hit.blocks:
            raise ValueError("an empty prefix hit has nothing to gather")
        return self.ops.gather_blocks([b.kv for b in hit.blocks], capacity or hit.num_tokens)

    def insert(self, tokens: Sequence[int], kv: KVCache, row: int = 0) -> int:
        """Store every full block of ``tokens`` not cached yet, then evict down to the budget.

        ``kv`` is a per-layer [B, Hkv, C, D] cache whose row ``row`` holds the keys and values
        of ``tokens`` at positions ``[0, len(tokens))``; block i copies positions ``[i *
        block_tokens, (i + 1) * block_tokens)`` of that row (a copy: once computed, the source
        cache is not kept alive). Cached blocks of the prompt are marked most recently used.
        Only as many leading blocks as the budget can hold are considered, and the walk stops
        at a digest that names another prefix (a collision). Queues the copies' evaluation
        without waiting for it.

        Returns: blocks newly stored. Older blocks are evicted first; the prompt's own chain
        always fits, as at most ``budget_bytes // block bytes`` of its blocks are considered.

        Raises:
            ValueError: ``row`` outside ``kv``'s batch, more tokens than ``kv``'s capacity, or a
                ``kv`` whose layers, heads, head dim or dtype differ from the blocks cached before.
        """
        return self.insert_rows([(tokens, row)], kv)[0]

    def insert_rows(self, prompts: Sequence[tuple[Sequence[int], int]], kv: KVCache) -> list[int]:
        """:meth:`insert` for several prompts of one cache: ``prompts`` are (tokens, row of
        ``kv``) pairs, stored in order (a block that an earlier prompt of the call stores is
        cached for the later ones). Prompts whose new blocks start at the same positions (the
        prefix-cache hits of one step, after one shared system prompt) share their copies: one
        :meth:`BlockOps.save_blocks` call per distinct set of starts, not one per prompt (on a
        GPU each call is about ``2 * layers`` kernel launches). Returns the blocks newly stored
        per prompt. Raises ValueError as :meth:`insert`, before anything is stored.
        """
        for tokens, row in prompts:
            if not 0 <= row < kv.batch:
                raise ValueError(f"row {row} is outside the cache's {kv.batch} rows")
            if len(tokens) > kv.capacity:
                raise ValueError(f"{len(tokens)} tokens do not fit a cache of {kv.capacity} positions")
        if self.budget_bytes <= 0:  # off (a model without attention layers has blocks of no bytes)
            return [0] * len(prompts)
        layout = (len(kv.keys), kv.keys[0].shape[1], kv.keys[0].shape[3], kv.dtype)
        if self._layout is not None and layout != self._layout:
            raise ValueError(f"KV layout (layers, Hkv, D, dtype) {layout} differs from the cached {self._layout}")
        block_bytes = 2 * layout[0] * layout[1] * self.block_tokens * layout[2] * kv.dtype.size
        copies: dict[tuple[int, ...], list[tuple[int, list[Block]]]] = {}  # starts -> (row, its new blocks)
        stored = []
        most = self.budget_bytes // block_bytes  # blocks of one prompt considered at most
        for tokens, row in prompts:
            new, new_at = self._add_chain(tokens, min(len(tokens) // self.block_tokens, most), block_bytes)
            stored.append(len(new))
            if new:
                copies.setdefault(tuple(i * self.block_tokens for i in new_at), []).append((row, new))
        for starts, rows in copies.items():
            saved = self.ops.save_blocks(kv, [row for row, _ in rows], list(starts), self.block_tokens)
            for block, kv_block in zip((b for _, new in rows for b in new), saved, strict=True):
                block.kv = kv_block
            self._layout = layout
        self._evict_until(lambda: self._nbytes <= self.budget_bytes)
        return stored

    def _add_chain(self, tokens: Sequence[int], n: int, block_bytes: int) -> tuple[list[Block], list[int]]:
        """Walk the first ``n`` blocks of ``tokens``, adding the ones not cached yet (their
        keys and values still to copy) and marking the chain most recently used. Returns the
        new blocks and their block indices."""
        B = self.block_tokens
        chain: list[Block] = []
        new: list[Block] = []
        new_at: list[int] = []
        parent, digest = None, ROOT_DIGEST
        for i in range(n):
            chunk = tuple(tokens[i * B : (i + 1) * B])
            digest = self._hash(digest, chunk)
            block = self._blocks.get(digest)
            if block is None:
                block = Block(digest, parent, chunk, _EMPTY, block_bytes)  # its keys and values follow
                self._blocks[digest] = block  # at once: a later block of this prompt may collide with it
                self._nbytes += block.nbytes
                new.append(block)
                new_at.append(i)
            elif block.parent is not parent or block.tokens != chunk:
                break  # the digest names another prefix: this one is not cacheable past here
            chain.append(block)
            parent = block
        self._touch(chain)
        return new, new_at

    def evict(self, bytes_needed: int) -> int:
        """Evict least recently used blocks (leaves first) until ``bytes_needed`` bytes are freed.

        For the engine to call before refusing a request for memory. Returns the bytes freed:
        at least ``bytes_needed`` unless the cache held less (then everything). Memory of a
        block that a live :class:`PrefixHit` still holds returns once that hit is dropped.
        """
        start = self._nbytes
        self._evict_until(lambda: start - self._nbytes >= bytes_needed)
        return start - self._nbytes

    def take_stat(self, model: str) -> PrefixCacheStat:
        """The counters' increase since the previous call, and the bytes held now (for
        :meth:`service.metrics.Metrics.record_prefix_cache`)."""
        now = (self.queried_tokens, self.hit_tokens, self.evicted_blocks)
        queried, hit, evicted = (a - b for a, b in zip(now, self._reported, strict=True))
        self._reported = now
        return PrefixCacheStat(model, queried, hit, evicted, self._nbytes)

    def _touch(self, chain: list[Block]) -> None:
        """Mark a chain (first block first) most recently used, each block after its child:
        the LRU's first block then never has a cached child."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.digest)

    def _evict_until(self, done: Callable[[], bool]) -> None:
        while self._blocks and not done():
            _, block = self._blocks.popitem(last=False)
            self._nbytes -= block.nbytes
            self.evicted_blocks += 1


class BlockOps(Protocol):
    """Where a block's keys and values are copied and gathered: this process's arrays
    (:data:`LOCAL_BLOCKS`), or every rank of a pipeline group, each on its own layers (the
    engine's executor, :mod:`service.engine.executor`)."""

    def save_blocks(self, kv: KVCache, rows: list[int], starts: list[int], block_tokens: int) -> list[mx.array]:
        """Blocks of ``block_tokens`` positions at ``starts`` of each of ``rows`` of ``kv``, as
        :func:`copy_blocks`, their evaluation queued."""
        ...

    def gather_blocks(self, blocks: list[mx.array], capacity: int) -> KVCache:
        """:func:`join_blocks`."""
        ...


class _LocalBlocks:
    """:class:`BlockOps` on this process's arrays."""

    def save_blocks(self, kv: KVCache, rows: list[int], starts: list[int], block_tokens: int) -> list[mx.array]:
        blocks = copy_blocks(kv, rows, starts, block_tokens)
        mx.async_eval(blocks)
        return blocks

    def gather_blocks(self, blocks: list[mx.array], capacity: int) -> KVCache:
        return join_blocks(blocks, capacity)


LOCAL_BLOCKS: BlockOps = _LocalBlocks()
