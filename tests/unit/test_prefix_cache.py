"""The prefix cache alone: hits by chained block hash, token checks against forged collisions,
LRU eviction by bytes, and its metrics. Caches are random arrays shaped like TINY's."""

from __future__ import annotations

import gc
import random

import mlx.core as mx
import pytest
from prometheus_client import CollectorRegistry

from models.kv_cache import KVCache
from service.engine.kv_blocks import padded_block_count
from service.engine.prefix_cache import LOCAL_BLOCKS, PrefixCache
from service.metrics import Metrics
from tests.support import TINY, new_cache, no_buffer_cache

BLOCK = 4
# keys and values x layers x [Hkv, BLOCK, D] float32
BLOCK_BYTES = 2 * TINY.num_hidden_layers * TINY.num_key_value_heads * BLOCK * TINY.dim_per_head * 4


def prompt_kv(capacity: int, batch: int = 1) -> KVCache:
    """A float32 cache of random keys and values, distinct at every position."""
    return new_cache(batch, capacity, fill=1.0)


def prefix(kv: KVCache, n: int, row: int = 0) -> KVCache:
    """Positions [0, n) of ``row``, as a batch-1 cache."""
    return KVCache([k[row : row + 1, :, :n] for k in kv.keys], [v[row : row + 1, :, :n] for v in kv.values])


def assert_kv_equal(got: KVCache, want: KVCache) -> None:
    assert got.dtype == want.dtype
    for a, b in zip(got.keys + got.values, want.keys + want.values, strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()


def cached(n_blocks: int = 100, **kwargs) -> PrefixCache:
    return PrefixCache(BLOCK, n_blocks * BLOCK_BYTES, **kwargs)


def test_a_shared_system_prompt_hits_across_requests_and_gathers_the_same_kv():
    cache = cached()
    system = list(range(10, 20))  # 2 full blocks and 2 tokens
    first = system + [50, 51, 52]
    kv = prompt_kv(len(first))
    assert cache.insert(first, kv) == 3 and len(cache) == 3 and cache.nbytes == 3 * BLOCK_BYTES

    hit = cache.match(system + [60, 61, 62, 63, 64])  # block 2 is [18, 19, 60, 61]: a miss
    assert hit.num_tokens == 8 and len(hit.blocks) == 2
    assert_kv_equal(cache.gather(hit), prefix(kv, 8))
    assert (cache.queried_tokens, cache.hit_tokens) == (15, 8)

    assert cache.insert(system + [60, 61, 62, 63, 64], prompt_kv(15)) == 1  # only the new block 2
    assert len(cache) == 4


def test_hits_are_whole_blocks_and_leave_one_token_to_prefill():
    cache = cached()
    tokens = list(range(12))  # 3 blocks
    cache.insert(tokens, prompt_kv(12))
    assert cache.match(tokens).num_tokens == 8  # the whole prompt cached: its last block is redone
    assert cache.match(tokens + [99]).num_tokens == 12
    assert cache.match(tokens[:11]).num_tokens == 8
    assert cache.match(tokens[:5]).num_tokens == 4
    assert cache.match(tokens[:4]).num_tokens == 0
    assert cache.match([]).num_tokens == 0


def test_a_differing_token_misses_from_its_block_on():
    cache = cached()
    tokens = list(range(16))
    cache.insert(tokens, prompt_kv(16))
    changed = tokens + [1]
    changed[5] = 99
    assert cache.match(changed).num_tokens == 4
    changed[0] = 99
    assert cache.match(changed).num_tokens == 0


def test_insert_copies_one_row_in_the_cache_dtype():
    cache = cached()
    tokens = list(range(9))
    kv = prompt_kv(64, 3)
    kv = KVCache([k.astype(mx.bfloat16) for k in kv.keys], [v.astype(mx.bfloat16) for v in kv.values])
    assert cache.insert(tokens, kv, row=1) == 2 and cache.nbytes == BLOCK_BYTES  # bfloat16: half of float32
    hit = cache.match(tokens)
    assert all(k.shape == (TINY.num_key_value_heads, BLOCK, TINY.dim_per_head) for k in hit.blocks[0].keys)
    assert_kv_equal(cache.gather(hit), prefix(kv, 8, row=1))


def test_blocks_do_not_keep_the_source_cache_alive():
    cache = cached()
    with no_buffer_cache():
        big = prompt_kv(2048, 2)
        mx.eval(big.keys, big.values)
        big_bytes = big.nbytes  # 2 MiB
        cache.insert(list(range(8)), big, row=1)
        held = mx.get_active_memory()
        del big
        gc.collect()
        freed = held - mx.get_active_memory()
    assert cache.nbytes == 2 * BLOCK_BYTES  # 4 KiB
    assert freed >= big_bytes  # all of the source: a view would hold all of it


class CountingOps:
    """The local block operations, counting save_blocks calls."""

    def __init__(self):
        self.saves: list[tuple[list[int], list[int]]] = []

    def save_blocks(self, kv, rows, starts, block_tokens):
        self.saves.append((list(rows), list(starts)))
        return LOCAL_BLOCKS.save_blocks(kv, rows, starts, block_tokens)

    def gather_blocks(self, blocks, capacity):
        return LOCAL_BLOCKS.gather_blocks(blocks, capacity)


def test_hits_of_one_step_store_their_new_blocks_in_one_copy_each_row_its_own():
    ops = CountingOps()
    cache = cached(ops=ops)
    system = list(range(100, 108))  # 2 blocks
    cache.insert(system + [1], prompt_kv(9))
    ops.saves.clear()
    # Three hits prefilled together (rows 2, 0, 3 of one cache), each with its own third block;
    # row 3 repeats row 2's prompt (n choices share a row's prompt) and stores nothing new.
    a, b = system + [1, 2, 3, 4, 9], system + [5, 6, 7, 8, 9]
    kv = prompt_kv(16, 4)
    assert cache.insert_rows([(a, 2), (b, 0), (a, 3)], kv) == [1, 1, 0]
    assert ops.saves == [([2, 0], [8])]  # one call: both new blocks start at position 8
    for tokens, row in ((a, 2), (b, 0)):  # each its own block 2 (the system blocks came from the first cache)
        got, want = cache.gather(cache.match(tokens)), prefix(kv, 12, row=row)
        for g, w in zip(got.keys + got.values, want.keys + want.values, strict=True):
            assert mx.array_equal(g[:, :, 8:], w[:, :, 8:]).item()

    # Prompts whose new blocks start elsewhere take a call of their own.
    c = list(range(200, 212)) + [1]
    assert cache.insert_rows([(system + [11, 12, 13, 14, 1], 1), (c, 3)], kv) == [1, 3]
    assert ops.saves[1:] == [([1], [8]), ([3], [0, 4, 8])]


def test_eviction_takes_the_least_recently_used_leaf_first():
    cache = cached(n_blocks=3)
    a, b, c = list(range(0, 9)), list(range(20, 25)), list(range(40, 45))
    cache.insert(a, prompt_kv(9))  # a0 <- a1
    cache.insert(b, prompt_kv(5))  # b0
    assert cache.match(a).num_tokens == 8  # a is now more recent than b
    cache.insert(c, prompt_kv(5))  # over budget: b0 goes
    assert [cache.match(p).num_tokens for p in (a, b, c)] == [8, 0, 4]
    assert cache.evicted_blocks == 1

    cache.insert(b, prompt_kv(5))  # LRU now a1 (a leaf, older than its parent a0), then a0, c0
    assert [cache.match(p).num_tokens for p in (a, b, c)] == [4, 4, 4]
    assert cache.evicted_blocks == 2


def test_memory_stays_within_the_budget_and_no_block_is_orphaned():
    rng = random.Random(0)
    cache = cached(n_blocks=7)
    system = [rng.randrange(TINY.vocab_size) for _ in range(8)]
    for _ in range(40):
        tokens = (system if rng.random() < 0.5 else []) + [rng.randrange(4) for _ in range(rng.randrange(1, 24))]
        hit = cache.match(tokens)
        assert hit.num_tokens <= len(tokens) - 1 and hit.num_tokens % BLOCK == 0
        cache.insert(tokens, prompt_kv(len(tokens)))
        assert cache.nbytes == len(cache) * BLOCK_BYTES <= cache.budget_bytes
        blocks = cache._blocks.values()
        assert all(b.parent is None or cache._blocks.get(b.parent.digest) is b.parent for b in blocks)
    assert cache.evicted_blocks > 0


def test_evict_frees_at_least_what_is_asked():
    cache = cached()
    cache.insert(list(range(24)), prompt_kv(24))
    assert cache.evict(0) == 0
    assert cache.evict(1) == BLOCK_BYTES  # whole blocks
    assert cache.evict(2 * BLOCK_BYTES + 1) == 3 * BLOCK_BYTES
    assert cache.match(list(range(24))).num_tokens == 8  # the tail went first
    assert cache.evict(10**9) == 2 * BLOCK_BYTES and len(cache) == 0 and cache.nbytes == 0
    assert cache.evicted_blocks == 6


def test_a_prompt_larger_than_the_budget_keeps_its_first_blocks():
    cache = cached(n_blocks=2)
    cache.insert(list(range(40)), prompt_kv(40))
    assert len(cache) == 2 and cache.evicted_blocks == 0
    assert cache.match(list(range(40))).num_tokens == 8


def test_budget_zero_disables_the_cache():
    cache = PrefixCache(BLOCK, 0)
    tokens = list(range(12))
    assert cache.insert(tokens, prompt_kv(12)) == 0 and len(cache) == 0 and cache.nbytes == 0
    assert cache.match(tokens + [1]).num_tokens == 0
    assert (cache.queried_tokens, cache.hit_tokens, cache.evicted_blocks) == (0, 0, 0)


def test_forged_equal_hashes_never_return_a_wrong_prefix():
    cache = cached(hash_fn=lambda parent, tokens: b"same")
    first = list(range(12))
    kv = prompt_kv(12)
    cache.insert(first, kv)  # block 1 collides with block 0: only block 0 is stored
    assert len(cache) == 1
    assert cache.match([7] * 12).num_tokens == 0  # another first block, the same digest
    assert cache.match(first[:4] + [7] * 8).num_tokens == 4
    hit = cache.match(first + [1])
    assert hit.num_tokens == 4
    assert_kv_equal(cache.gather(hit), prefix(kv, 4))


def test_the_same_tokens_after_another_parent_do_not_match():
    """A digest that ignores the parent: block [4..8) after another first block collides."""
    cache = cached(hash_fn=lambda parent, tokens: repr(tokens).encode())
    x, y = list(range(8)), [9, 9, 9, 9] + list(range(4, 8))
    cache.insert(x, prompt_kv(8))
    kv_y = prompt_kv(8)
    cache.insert(y, kv_y)  # y's second block collides with x's: only y's first is stored
    assert len(cache) == 3
    hit = cache.match(y + [1])
    assert hit.num_tokens == 4
    assert_kv_equal(cache.gather(hit), prefix(kv_y, 4))
    assert cache.match(x + [1]).num_tokens == 8


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixCache(0, 1)
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCache(BLOCK, -1)
    cache = cached()
    with pytest.raises(ValueError, match="row 2"):
        cache.insert(list(range(4)), prompt_kv(4, 2), row=2)
    with pytest.raises(ValueError, match="do not fit"):
        cache.insert(list(range(5)), prompt_kv(4))
    cache.insert(list(range(4)), prompt_kv(4))
    half = prompt_kv(4)
    with pytest.raises(ValueError, match="layout"):
        cache.insert(list(range(4, 8)), KVCache([k.astype(mx.float16) for k in half.keys], half.values))
    with pytest.raises(ValueError, match="empty"):
        cache.gather(cache.match([1]))


def test_metrics_record_the_counters_increase_and_the_bytes_held():
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    metrics.init_model("m")

    def sample(name):
        return metrics.registry.get_sample_value(f"stepserve_prefix_cache_{name}", {"model": "m"})

    names = ("queried_tokens_total", "hit_tokens_total", "evictions_total", "bytes")
    assert [sample(n) for n in names] == [0, 0, 0, 0]
    cache = cached(n_blocks=1)
    cache.insert(list(range(8)), prompt_kv(8))
    cache.match(list(range(8)))
    metrics.record_prefix_cache(cache.take_stat("m"))
    cache.insert(list(range(50, 58)), prompt_kv(8))  # evicts the first block
    cache.match(list(range(9)))
    metrics.record_prefix_cache(cache.take_stat("m"))
    assert [sample(n) for n in names] == [17, 4, 1, BLOCK_BYTES]


def test_block_counts_are_padded_to_a_power_of_two_within_the_staging_capacity():
    assert [padded_block_count(n, 64) for n in (1, 2, 3, 5, 17, 32, 33, 47, 64)] == [1, 2, 4, 8, 32, 32, 64, 64, 64]
    assert padded_block_count(47, 50) == 50 and padded_block_count(47, 47) == 47  # never past what the cache holds


@pytest.mark.parametrize(("count", "capacity"), [(1, 4), (3, 12), (3, 40), (5, 24), (5, 64), (7, 30)])
def test_a_gather_holds_the_blocks_then_zeros_up_to_its_capacity(count, capacity):
    cache = cached()
    tokens = list(range(100, 100 + count * BLOCK + 1))
    kv = prompt_kv(len(tokens))
    cache.insert(tokens, kv)
    hit = cache.match(tokens)
    assert len(hit.blocks) == count
    got = cache.gather(hit, capacity)
    n = count * BLOCK
    for g, want in zip(got.keys + got.values, prefix(kv, n).keys + prefix(kv, n).values, strict=True):
        assert g.shape[2] == capacity
        assert mx.array_equal(g[:, :, :n], want).item() and not mx.any(g[:, :, n:]).item()
