"""The KV block pool's host side: allocation, prefix hits on shared blocks, copy-on-write of a
shared partial block, LRU eviction, refusal when full, and a seeded fuzz against a tiny pool
that checks the bookkeeping and the simulated device contents after every operation."""

from __future__ import annotations

import random

import pytest

from service.engine.block_pool import (
    NULL_BLOCK,
    Allocation,
    BlockCopy,
    BlockPool,
    NoFreeBlocks,
    PoolInvariantError,
    sha256_block_hash,
)

BT = 4  # tokens per block in these tests


class Device:
    """What the device's pool would hold: per block and offset, the prefix whose last token's
    keys and values were written there (they depend on every earlier token through attention,
    so a block hit after the wrong prefix reads back wrong). Applies an operation's copies and
    writes as the engine would, so a test can read each sequence back through its table."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.slots: dict[int, list[tuple[int, ...]]] = {}
        self.expected: dict[object, list[int]] = {}  # each live sequence's tokens

    def verify(self) -> None:
        """Every live sequence reads back its own prefixes through its block table."""
        for seq_id, tokens in self.expected.items():
            assert self.read(seq_id, len(tokens)) == [tuple(tokens[: p + 1]) for p in range(len(tokens))], seq_id

    def write(self, seq_id, tokens: list[int], start: int) -> None:
        """Write the keys and values of positions ``start..len(tokens) - 1`` of the sequence."""
        table = self.pool.block_table(seq_id)
        for p in range(start, len(tokens)):
            self.slots.setdefault(table[p // BT], [()] * BT)[p % BT] = tuple(tokens[: p + 1])

    def copy(self, copies: list[BlockCopy]) -> None:
        for src, dst in copies:
            self.slots[dst] = list(self.slots.get(src, [()] * BT))

    def read(self, seq_id, length: int) -> list[tuple[int, ...]]:
        table = self.pool.block_table(seq_id)
        return [self.slots.get(table[p // BT], [()] * BT)[p % BT] for p in range(length)]

    def tokens(self, seq_id, length: int) -> list[int]:
        """The sequence's tokens as its table reads them back."""
        return [prefix[-1] if prefix else -1 for prefix in self.read(seq_id, length)]


def admit(pool: BlockPool, device: Device, seq_id, tokens: list[int]) -> Allocation:
    """Allocate, prefill the tokens the hit does not cover, and publish them."""
    allocation = pool.allocate(seq_id, tokens)
    device.write(seq_id, tokens, allocation.num_cached_tokens)
    pool.mark_computed(seq_id, len(tokens))
    device.expected[seq_id] = list(tokens)
    return allocation


def grow(pool: BlockPool, device: Device, seq_id, tokens: list[int]) -> list[BlockCopy]:
    """Append slots, do the copies, write the tokens and publish them."""
    start = pool.num_tokens(seq_id)
    copies = pool.append_slots(seq_id, tokens)
    device.copy(copies)
    device.expected[seq_id] += tokens
    device.write(seq_id, device.expected[seq_id], start)
    pool.mark_computed(seq_id, start + len(tokens))
    return copies


def test_allocation_takes_one_block_per_block_tokens_and_free_returns_them():
    pool = BlockPool(num_blocks=9, block_tokens=BT)
    allocation = pool.allocate("a", list(range(10)))  # 10 tokens: 3 blocks, the last partial
    assert len(allocation.block_table) == 3 and allocation.num_cached_tokens == 0
    assert NULL_BLOCK not in allocation.block_table
    assert pool.stats().used == 3 and pool.stats().free == 5 and pool.stats().total == 8
    assert pool.append_slots("a", [10, 11]) == []  # fills the partial block: no new block
    assert len(pool.block_table("a")) == 3
    pool.append_slots("a", [12])  # position 12 starts block 3
    assert len(pool.block_table("a")) == 4 and pool.num_tokens("a") == 13
    pool.check()
    pool.free("a")  # nothing was marked computed: every block goes back free, none cached
    assert pool.stats() == pool.stats().__class__(total=8, used=0, cached=0, free=8)
    pool.check()


def test_a_prefix_hit_shares_the_computed_full_blocks():
    pool = BlockPool(num_blocks=16, block_tokens=BT)
    prompt = list(range(100, 111))  # 11 tokens: blocks 0 and 1 full, block 2 partial
    pool.allocate("a", prompt)
    assert pool.allocate("early", prompt).num_cached_tokens == 0  # nothing published before it is computed
    pool.free("early")
    pool.mark_computed("a", len(prompt))
    hit = pool.allocate("b", [*prompt[:8], 7, 7, 7])  # shares the first 8 tokens
    a_table = pool.block_table("a")
    assert hit.num_cached_tokens == 8 and list(hit.block_table[:2]) == a_table[:2]
    assert hit.block_table[2] != a_table[2]
    assert pool.hit_tokens == 8 and pool.queried_tokens == 3 * len(prompt)
    pool.check()
    # a different first block changes every digest after it: no hit on the second block
    assert pool.allocate("c", [0, 0, 0, 0, *prompt[4:]]).num_cached_tokens == 0
    pool.check()


def test_a_hit_leaves_the_last_prompt_token_to_compute():
    pool = BlockPool(num_blocks=16, block_tokens=BT)
    prompt = list(range(8))  # exactly two blocks
    admit(pool, Device(pool), "a", prompt)
    hit = pool.allocate("b", prompt)
    assert hit.num_cached_tokens == 4  # not 8: the last token's logits are needed
    assert pool.allocate("c", prompt + [9]).num_cached_tokens == 8
    pool.check()


def test_cached_blocks_survive_their_sequence_and_are_hit_from_the_lru():
    pool = BlockPool(num_blocks=8, block_tokens=BT)
    prompt = list(range(9))
    admit(pool, Device(pool), "a", prompt)
    pool.free("a")
    assert pool.stats().cached == 2 and pool.stats().used == 0  # the two full blocks stay hittable
    hit = pool.allocate("b", prompt)
    assert hit.num_cached_tokens == 8 and pool.stats().cached == 0 and pool.stats().used == 3
    pool.check()


def test_a_collision_is_a_miss_not_a_wrong_prefix():
    pool = BlockPool(num_blocks=8, block_tokens=BT, hash_fn=lambda parent, tokens: b"same")
    admit(pool, Device(pool), "a", [1, 2, 3, 4, 5])
    assert pool.allocate("b", [9, 9, 9, 9, 5]).num_cached_tokens == 0  # same digest, other tokens
    assert pool.allocate("c", [1, 2, 3, 4, 6]).num_cached_tokens == 4
    pool.check()


def test_copy_on_write_of_a_shared_partial_block():
    pool = BlockPool(num_blocks=8, block_tokens=BT)
    device = Device(pool)
    admit(pool, device, "a", [1, 2, 3, 4, 5, 6])  # block 1 partial (positions 4, 5)
    pool.fork("a", "b")
    device.expected["b"] = list(device.expected["a"])
    assert pool.block_table("a") == pool.block_table("b")
    shared = pool.block_table("a")
    copies = grow(pool, device, "b", [70])  # b writes position 6 into the shared partial block
    assert copies == [BlockCopy(shared[1], pool.block_table("b")[1])] and copies[0].dst != copies[0].src
    assert pool.block_table("b")[0] == shared[0]  # the full block stays shared
    assert grow(pool, device, "a", [80]) == []  # a alone holds the old one now: written in place
    assert pool.block_table("a") == shared
    assert device.tokens("a", 7) == [1, 2, 3, 4, 5, 6, 80]
    assert device.tokens("b", 7) == [1, 2, 3, 4, 5, 6, 70]
    pool.check()


def test_a_truncation_into_a_published_block_is_copied_or_unpublished_before_a_write():
    pool = BlockPool(num_blocks=8, block_tokens=BT)
    device = Device(pool)
    admit(pool, device, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # blocks 0, 1 full and published
    pool.truncate("a", 6)  # rejected speculative tokens: block 1 is partial again
    del device.expected["a"][6:]
    grow(pool, device, "a", [60])  # a alone holds it: written in place, unpublished first
    assert pool.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]).num_cached_tokens == 4
    pool.check()
    pool.free("b")
    device.expected.pop("b", None)
    admit(pool, device, "c", [1, 2, 3, 4, 5, 6, 60, 61, 62])
    pool.truncate("c", 5)
    del device.expected["c"][5:]
    admit(pool, device, "d", [1, 2, 3, 4, 5, 6, 60, 61, 62])  # hits c's block 1, still published
    assert pool.block_table("d")[:2] == pool.block_table("c")[:2]
    assert len(grow(pool, device, "c", [50])) == 1  # shared now: c gets a copy
    device.verify()
    pool.check()


def test_a_truncated_sequence_publishes_what_it_regrows_under_its_new_prefix():
    pool = BlockPool(num_blocks=16, block_tokens=BT)
    device = Device(pool)
    old = [1] * 4 + [2] * 4 + [3] * 4
    admit(pool, device, "a", [*old, 9])
    pool.truncate("a", 4)  # blocks 1 and 2 stay cached under the old prefix
    del device.expected["a"][4:]
    grow(pool, device, "a", [5] * 8 + [7] * 4 + [0])  # block 3 now follows [1]*4 + [5]*8
    b = admit(pool, device, "b", [*old, 7, 7, 7, 7, 0])  # the old prefix, then a's block 3 tokens
    assert b.num_cached_tokens == 12  # the old blocks, but not a's block 3: another prefix
    assert pool.allocate("c", [1] * 4 + [5] * 8 + [7] * 4 + [0]).num_cached_tokens == 16
    device.verify()
    pool.check()


def test_lru_evicts_the_least_recently_used_tail_first_and_only_when_nothing_is_free():
    pool = BlockPool(num_blocks=7, block_tokens=BT)  # 6 usable blocks
    device = Device(pool)
    admit(pool, device, "old", list(range(0, 9)))  # 2 full + 1 partial
    pool.free("old")  # cached: old's block 1 then block 0 (tail first)
    admit(pool, device, "new", list(range(100, 109)))
    pool.free("new")
    assert pool.stats().cached == 4 and pool.stats().free == 2
    pool.allocate("x", [7] * 8)  # 2 blocks: the free ones, no eviction
    assert pool.evicted_blocks == 0 and pool.stats().cached == 4
    pool.allocate("y", [8])  # evicts old's tail block
    assert pool.evicted_blocks == 1
    pool.free("x")  # x's blocks were never computed: free, not cached
    assert pool.allocate("z", list(range(0, 9))).num_cached_tokens == 4  # old's head survives
    pool.check()
    pool.free("z")
    pool.free("y")
    # "new" was freed after "old": its blocks are younger and still hit whole
    assert pool.allocate("w", list(range(100, 109))).num_cached_tokens == 8
    pool.check()


def test_refused_when_full_and_nothing_changes():
    pool = BlockPool(num_blocks=5, block_tokens=BT)  # 4 usable blocks
    pool.allocate("a", list(range(12)))  # 3 blocks
    before = (pool.stats(), pool.block_table("a"))
    assert not pool.can_allocate(list(range(50, 58)))  # 2 needed, 1 left
    with pytest.raises(NoFreeBlocks):
        pool.allocate("b", list(range(50, 58)))
    assert "b" not in pool and (pool.stats(), pool.block_table("a")) == before
    assert pool.can_allocate([1]) and not pool.can_allocate([1], reserve=1)
    assert pool.can_append("a", 4) and not pool.can_append("a", 5)
    with pytest.raises(NoFreeBlocks):
        pool.append_slots("a", [0] * 5)
    assert (pool.stats(), pool.block_table("a")) == before and pool.num_tokens("a") == 12
    pool.check()


def test_admission_counts_cached_hits_as_not_needed():
    pool = BlockPool(num_blocks=5, block_tokens=BT)  # 4 usable blocks
    prompt = list(range(13))  # 4 blocks
    admit(pool, Device(pool), "a", prompt)
    assert not pool.can_allocate(prompt)  # no block free, and the hit blocks are in use
    pool.free("a")  # 3 full blocks cached, 1 free
    assert pool.can_allocate(prompt)  # 3 hits + 1 new
    assert not pool.can_allocate(prompt, reserve=1)
    assert pool.can_allocate(list(range(100, 113)))  # 4 new of 4 available (evicting the cache)
    assert not pool.can_allocate(list(range(100, 117)))  # 5 new
    pool.check()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1, block_tokens=BT)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=4, block_tokens=0)
    pool = BlockPool(num_blocks=4, block_tokens=BT)
    pool.allocate("a", [1])
    with pytest.raises(ValueError):
        pool.allocate("a", [1])
    with pytest.raises(ValueError):
        pool.allocate("b", [])
    with pytest.raises(ValueError):
        pool.mark_computed("a", 2)
    with pytest.raises(ValueError):
        pool.truncate("a", 0)
    with pytest.raises(KeyError):
        pool.free("nobody")


def test_check_catches_a_corrupted_pool():
    pool = BlockPool(num_blocks=6, block_tokens=BT)
    pool.allocate("a", list(range(5)))
    pool.check()
    pool._blocks[pool.block_table("a")[0]].refs += 1  # a reference nobody holds
    with pytest.raises(PoolInvariantError):
        pool.check()


def test_the_digest_matches_the_prefix_cache():
    from service.engine.prefix_cache import sha256_block_hash as prefix_cache_hash

    assert sha256_block_hash(b"", [1, 2, 3]) == prefix_cache_hash(b"", [1, 2, 3])


@pytest.mark.parametrize("seed", range(8))
def test_fuzz_arrivals_appends_forks_truncations_and_frees(seed):
    """Random traffic against a tiny pool: the bookkeeping is consistent after every operation,
    every live sequence reads back its own prefixes through its table (so no block is shared
    wrongly, overwritten while shared, or hit after another prefix), and once everything is
    freed every block is free or cached. Some arrivals publish their blocks late or never (still
    being prefilled when freed), so the pending map is checked throughout. A vocabulary of 3
    makes sequences regrow the same blocks after truncations, forks and frees, where stale digests would be hit."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks=14, block_tokens=BT)
    device = Device(pool)
    live = device.expected
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    refused = hits = copies = truncated = pending = 0
    for step in range(500):
        op = rng.random()
        if op < 0.3 or not live:  # an arrival, often sharing a prefix
            tokens = list(rng.choice(prefixes)) if rng.random() < 0.7 else []
            tokens += [rng.randrange(3) for _ in range(rng.randrange(0 if tokens else 1, 10))]
            assert pool.pending(tokens) <= (len(tokens) - 1) // BT - pool.peek(tokens) // BT
            if not pool.can_allocate(tokens):
                refused += 1
                with pytest.raises(NoFreeBlocks):
                    pool.allocate(step, tokens)
            elif rng.random() < 0.3:  # still being prefilled: its blocks published later, or never
                allocation = pool.allocate(step, tokens)
                hits += allocation.num_cached_tokens > 0
                device.write(step, tokens, allocation.num_cached_tokens)
                device.expected[step] = list(tokens)
                pool.mark_computed(step, rng.choice([0, rng.randrange(len(tokens) + 1)]))
            else:
                hits += admit(pool, device, step, tokens).num_cached_tokens > 0
        elif op < 0.6:  # decode, or a speculative verify of several tokens
            seq_id = rng.choice(list(live))
            new = [rng.randrange(3) for _ in range(rng.choice([1, 1, 1, 3]))]
            if pool.can_append(seq_id, len(new)):
                copies += len(grow(pool, device, seq_id, new))
            else:
                refused += 1
                with pytest.raises(NoFreeBlocks):
                    pool.append_slots(seq_id, new)
        elif op < 0.7:  # parallel sampling
            seq_id = rng.choice(list(live))
            pool.fork(seq_id, step)
            live[step] = list(live[seq_id])
        elif op < 0.8:  # rejected speculative tokens
            seq_id = rng.choice(list(live))
            keep = rng.randrange(1, len(live[seq_id]) + 1)
            pool.truncate(seq_id, keep)
            truncated += keep < len(live[seq_id])
            del live[seq_id][keep:]
        else:  # finished, cancelled or preempted
            seq_id = rng.choice(list(live))
            pool.free(seq_id)
            del live[seq_id]
        pool.check()
        device.verify()
        pending += bool(pool._pending)
    for seq_id in list(live):
        pool.free(seq_id)
    pool.check()
    stats = pool.stats()
    assert stats.used == 0 and stats.free + stats.cached == stats.total and not pool._pending
    assert refused and hits and copies and truncated and pending and pool.evicted_blocks  # every path was reached


def test_a_prompts_blocks_are_pending_until_published_freed_or_truncated():
    """A sequence's unpublished full prompt blocks are pending in it from allocation: another
    prompt sharing them counts them (up to the blocks it could hit), its owner does not; they
    leave the pending map as they are published, when the owner is freed, truncated before
    them, or when another sequence publishes the same prefix first."""
    pool = BlockPool(num_blocks=20, block_tokens=BT)
    shared = list(range(1, 13))  # 3 full blocks
    pool.allocate("a", shared + [50, 51])
    assert pool.pending(shared + [60]) == 3
    assert pool.pending(shared + [60], "a") == 0  # its own blocks
    assert pool.pending(shared) == 2  # the last block of a prompt is never hit: never waited for
    assert pool.pending([9] + shared) == 0  # another prefix
    pool.check()
    pool.mark_computed("a", 5)  # its first chunk: one block published, two pending
    assert pool.peek(shared + [60]) == 4 and pool.pending(shared + [60]) == 2
    pool.check()
    pool.truncate("a", 9)  # keeps blocks 0 and 1 whole: only block 1 is still pending
    assert pool.pending(shared + [60]) == 1
    pool.check()
    pool.free("a")
    assert pool.pending(shared + [60]) == 0 and not pool._pending
    pool.check()

    pool.allocate("b", shared + [70])  # b computes block 0 again (a's is cached: a hit) and blocks 1, 2
    assert pool.num_computed("b") == 4 and pool.pending(shared + [60]) == 2
    pool.allocate("c", shared + [80])  # b's pending blocks: c owns none of them
    assert pool.pending(shared + [60], "c") == 2
    pool.mark_computed("c", len(shared))  # c publishes them first: pending in b no more
    assert pool.pending(shared + [60]) == 0 and not pool._pending
    pool.check()
    pool.mark_computed("b", len(shared) + 1)
    pool.check()
    for seq in ("b", "c"):
        pool.free(seq)
    pool.check()


def test_a_collision_with_a_pending_block_is_not_waited_for():
    def colliding(parent: bytes, tokens) -> bytes:
        return parent + b"x"  # every block at one depth collides

    pool = BlockPool(num_blocks=10, block_tokens=BT, hash_fn=colliding)
    pool.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert pool.pending([1, 2, 3, 4, 9]) == 1
    assert pool.pending([5, 5, 5, 5, 9]) == 0  # same digest, other tokens
    pool.check()


def test_check_catches_a_corrupted_pending_map():
    pool = BlockPool(num_blocks=6, block_tokens=BT)
    pool.allocate("a", list(range(9)))
    pool.check()
    pool._seqs["a"].pending.clear()  # the map still names a's blocks
    with pytest.raises(PoolInvariantError):
        pool.check()


def test_tokens_named_after_their_slots_are_published_and_hit():
    """A decode step takes slots before it knows their tokens: named later (:meth:`set_tokens`),
    the blocks they fill are published under them (a preempted sequence's output)."""
    pool = BlockPool(num_blocks=8, block_tokens=BT)
    device = Device(pool)
    admit(pool, device, "a", [1, 2, 3, 4, 5])
    assert pool.num_computed("a") == 4
    pool.append_slots("a", [0, 0, 0, 0])  # slots for positions 5..8, tokens unknown yet
    with pytest.raises(ValueError):
        pool.set_tokens("a", 2, [9])  # inside a block already digested
    with pytest.raises(ValueError):
        pool.set_tokens("a", 5, [6] * 5)  # past its slots
    pool.set_tokens("a", 4, [5, 6, 7, 8])
    pool.mark_computed("a", 8)
    assert pool.num_computed("a") == 8
    pool.free("a")
    assert pool.peek([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    assert pool.peek([1, 2, 3, 4, 5, 0, 0, 0, 9]) == 4  # placeholders were not what got published
    pool.check()


def test_admission_counts_the_reserve_and_only_uncached_blocks():
    pool = BlockPool(num_blocks=7, block_tokens=BT)  # 6 usable blocks
    admit(pool, Device(pool), "a", list(range(12)))  # 3 blocks, all full
    pool.free("a")  # 3 cached, 3 free
    prompt = list(range(12)) + [50, 51, 52, 53, 54]  # hits 3 blocks, needs 2 new
    assert pool.peek(prompt) == 12
    assert pool.can_allocate(prompt, reserve=1) and not pool.can_allocate(prompt, reserve=2)
    with pytest.raises(NoFreeBlocks):
        pool.allocate("b", prompt, reserve=2)
    pool.check()
    assert pool.allocate("b", prompt, reserve=1).num_cached_tokens == 12
    assert pool.stats().used == 5 and pool.stats().free == 1
    pool.fork("b", "c")
    assert pool.append_cost("c", 1) == 1  # its partial last block is shared: a copy first
    assert pool.append_cost("c", 4) == 2  # the copy, then a block for position 20
    pool.check()


def test_without_caching_nothing_is_published_hit_or_counted():
    pool = BlockPool(num_blocks=8, block_tokens=BT, caching=False)
    admit(pool, Device(pool), "a", list(range(9)))
    assert pool.num_computed("a") == 0
    pool.free("a")
    assert pool.stats().cached == 0 and pool.stats().free == 7
    assert pool.allocate("b", list(range(9))).num_cached_tokens == 0
    assert pool.queried_tokens == pool.hit_tokens == 0
    pool.check()


def test_evict_cached_frees_every_cached_block():
    pool = BlockPool(num_blocks=8, block_tokens=BT)
    admit(pool, Device(pool), "a", list(range(9)))
    admit(pool, Device(pool), "b", [7] * 9)
    pool.free("a")
    assert pool.num_cached == 2
    assert pool.evict_cached() == 2 and pool.evicted_blocks == 2
    assert pool.peek(list(range(9))) == 0 and pool.peek([7] * 9) == 8  # b's, held, stay published
    assert pool.stats().used == 3 and pool.stats().free == 4
    pool.check()
