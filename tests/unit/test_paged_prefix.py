"""Prefix reuse through the paged KV pool (``kv_cache = "paged"``) on a tiny random model, the
engine stepped on this thread: a request whose prompt starts with blocks another request
computed references them (no copy, no second store) and prefills only the rest, with the tokens
of a cold pool and of the static cache's prefix cache; requests sharing a prefix hold its blocks
once; a full pool evicts cached blocks, least recently used first, before it preempts anyone; a
shared partial block is copied before either request writes it; a preempted request resumes
from its own published blocks, generated tokens included; the prefix metrics count pool hits."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from prometheus_client import CollectorRegistry

from models.kv_cache import KVCache
from models.loader import LoadedModel
from service.engine.buckets import BucketTable
from service.engine.core import Engine
from service.engine.sequence import FinalEvent, SamplingParams, Sequence
from service.metrics import Metrics
from tests.support import TINY, WIDE, WordTokenizer, engine_at, prefill_one, random_params

BUCKETS = BucketTable(batch=(1, 2, 4), prompt=(8, 16), capacity=(32, 64))
BT = 4  # kv_block_tokens
PREFIX = [1 + (7 * i) % 90 for i in range(36)]  # a 36-token shared prefix: 9 full blocks


@pytest.fixture(scope="module")
def params():
    return random_params(seed=5)


def tiny_model(args, params) -> LoadedModel:
    """A tiny random model of ``args`` with a word tokenizer (no stop tokens), float32."""
    tokenizer: Any = WordTokenizer(frozenset())
    return LoadedModel("tiny", Path("-"), args, params, tokenizer, mx.float32, "dequantized", 0.0)


def make_engine(params, args=TINY, buckets: BucketTable = BUCKETS, **settings) -> Engine:
    """An engine (not started) on a tiny model (``args``, ``params``) prefilling in chunks of 8
    tokens, its steps compiled on first use, counted as serving (``ready`` set: metrics
    recorded). Paged with a prefix cache in blocks of :data:`BT` unless ``settings`` say
    otherwise."""
    model = tiny_model(args, params)
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    keys = {
        "kv_cache": "paged",
        "kv_block_tokens": BT,
        "kv_pool_tokens": 256,
        "prefix_cache_bytes": 10**6,
        "prefill_chunk_tokens": 8,
        "max_batched_tokens": 16,
        **settings,
    }
    engine = engine_at(model, buckets, metrics, **keys)
    engine.ready.set()
    return engine


def request(engine: Engine, prompt: list[int], max_tokens: int, **params) -> Sequence:
    """A request of ``prompt`` (ignoring stop tokens), its final event kept in ``seq.final``."""
    finals: list[FinalEvent] = []
    seq = Sequence(
        list(prompt),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
        engine.model.tokenizer.detokenizer(),
        lambda event: finals.append(event) if isinstance(event, FinalEvent) else None,
    )
    seq.finals = finals  # type: ignore[attr-defined]
    return seq


def final(seq: Sequence) -> FinalEvent:
    """``seq``'s final event (it ended once)."""
    finals = seq.finals  # type: ignore[attr-defined]
    assert len(finals) == 1, finals
    return finals[0]


def run(engine: Engine, seqs: list[Sequence], check=None, steps_between: int = 0) -> None:
    """Submit ``seqs`` (``steps_between`` engine steps after each), then :func:`finish` them."""
    for seq in seqs:
        engine.submit(seq)
        for _ in range(steps_between):
            engine.step()
            if check is not None:
                check(engine)
    finish(engine, seqs, check)


def finish(engine: Engine, seqs: list[Sequence], check=None) -> None:
    """Step until every one of ``seqs`` has ended and no step is in flight; ``check(engine)``
    after every step."""
    while not all(s.finish_reason is not None for s in seqs) or engine.runner.busy:
        engine.step()
        if check is not None:
            check(engine)


def consistent(engine: Engine) -> None:
    """The pool's bookkeeping holds after the step, and an idle engine's requests hold no block."""
    paged = engine.paged
    assert paged is not None
    paged.blocks.check()
    if engine.idle and not engine.runner.busy:
        assert paged.blocks.stats().used == 0, paged.blocks.stats()


def reference(params, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of ``prompt`` alone, each step a whole prefill of everything so far."""
    out: list[int] = []
    while len(out) < max_tokens:
        logits, _ = prefill_one(params, prompt + out)
        out.append(cast(int, mx.argmax(logits).item()))
    return out


def sample(engine: Engine, name: str, **labels) -> float:
    return engine.metrics.registry.get_sample_value(name, {"model": "tiny", **labels}) or 0.0


def test_a_pool_hit_references_the_blocks_and_gives_the_cold_pools_and_the_static_caches_tokens(params):
    first, second = PREFIX + [91, 92, 93], PREFIX + [94, 95]  # 39 and 38 tokens
    warm = make_engine(params)
    a, b = request(warm, first, 6), request(warm, second, 6)
    run(warm, [a], consistent)
    assert warm.paged is not None
    cached = warm.paged.blocks.stats().cached
    assert cached >= len(PREFIX) // BT  # a's blocks stay cached once it ended
    run(warm, [b], consistent)
    assert final(b).cached_tokens == len(PREFIX)
    assert sample(warm, "stepserve_prefix_cache_hit_tokens_total") == len(PREFIX)
    assert sample(warm, "stepserve_prefix_cache_queried_tokens_total") == len(first) + len(second)
    assert len(warm.prefix) == 0 and warm.prefix_cache_bytes == 0  # no second store of the blocks

    cold = make_engine(params)  # b alone, nothing cached
    alone = request(cold, second, 6)
    run(cold, [alone], consistent)
    assert final(alone).cached_tokens == 0

    static = make_engine(params, kv_cache="static", kv_pool_tokens=None, prefix_block_tokens=BT)
    sa, sb = request(static, first, 6), request(static, second, 6)
    run(static, [sa])
    run(static, [sb])
    assert final(sb).cached_tokens == len(PREFIX)  # the static prefix cache's hit

    expected = reference(params, second, 6)
    assert b.output_ids == alone.output_ids == sb.output_ids == expected
    assert a.output_ids == sa.output_ids == reference(params, first, 6)


def test_a_request_that_ends_at_its_first_token_still_leaves_its_prompt_cached(params):
    """max_tokens 1: the request never joins the decode batch; its prefilled keys and values
    are written into its blocks as it ends, and the next prompt sharing them hits."""
    engine = make_engine(params)
    one = request(engine, PREFIX + [91], 1)
    run(engine, [one], consistent)
    assert one.output_ids and final(one).completion_tokens == 1
    again = request(engine, PREFIX + [92], 3)
    run(engine, [again], consistent)
    assert final(again).cached_tokens == len(PREFIX)
    assert again.output_ids == reference(params, PREFIX + [92], 3)


def test_no_prefix_cache_hits_nothing_and_caches_nothing(params):
    engine = make_engine(params, prefix_cache_bytes=0)
    a, b = request(engine, PREFIX + [91], 4), request(engine, PREFIX + [92], 4)
    run(engine, [a], consistent)
    assert engine.paged is not None and engine.paged.blocks.stats().cached == 0
    run(engine, [b], consistent)
    assert final(b).cached_tokens == 0
    assert sample(engine, "stepserve_prefix_cache_hit_tokens_total") == 0
    assert b.output_ids == reference(params, PREFIX + [92], 4)


def test_requests_sharing_a_prefix_hold_its_blocks_once(params):
    engine = make_engine(params)
    paged = engine.paged
    assert paged is not None
    a, b = request(engine, PREFIX + [91, 92], 16), request(engine, PREFIX + [93], 16)
    engine.submit(a)
    while not a.output_ids:  # a is prefilled and decoding: its prompt's blocks are published
        engine.step()
    engine.submit(b)
    while not b.output_ids:
        engine.step()
    pool = paged.blocks
    table_a, table_b = pool.block_table(id(a)), pool.block_table(id(b))
    shared = len(PREFIX) // BT
    assert table_a[:shared] == table_b[:shared]
    assert not set(table_a[shared:]) & set(table_b[shared:])
    assert pool.stats().used == len(set(table_a) | set(table_b)) == len(table_a) + len(table_b) - shared
    finish(engine, [a, b], consistent)
    assert final(b).cached_tokens == len(PREFIX)
    assert a.output_ids == reference(params, PREFIX + [91, 92], 16)
    assert b.output_ids == reference(params, PREFIX + [93], 16)


def test_admission_counts_only_the_blocks_not_already_cached(params):
    """A pool of 14 blocks: a holds 10 to 11 of them; b, sharing a's 9 prefix blocks, needs one
    block of its own and is admitted beside a (counted whole, its 10 blocks would keep it
    waiting until a ended)."""
    engine = make_engine(params, kv_pool_tokens=14 * BT)
    paged = engine.paged
    assert paged is not None
    a, b = request(engine, PREFIX + [91, 92], 4), request(engine, PREFIX + [93], 4)
    together = []
    run(engine, [a, b], lambda e: (consistent(e), together.append({id(a), id(b)} <= {id(s) for s in e.batch.live})))
    assert any(together) and paged.preemptions == 0
    assert a.output_ids == reference(params, a.prompt_ids, 4)
    assert b.output_ids == reference(params, b.prompt_ids, 4)


def test_a_full_pool_evicts_cached_blocks_least_recently_used_first_before_preempting(params):
    # 12 blocks. x and y each leave 4 full blocks cached; z then needs 6 of its own: 4 free and
    # 2 evicted, x's (the least recently used), from its tail. Nobody is preempted.
    engine = make_engine(params, kv_pool_tokens=12 * BT)
    paged = engine.paged
    assert paged is not None
    pool = paged.blocks
    x, y = [10 + i for i in range(16)], [40 + i for i in range(16)]
    run(engine, [request(engine, x, 4)], consistent)
    run(engine, [request(engine, y, 4)], consistent)
    assert pool.stats().cached == 8 and pool.stats().free == 4
    hit_x, hit_y = pool.peek(x + [1]), pool.peek(y + [1])
    assert hit_x == hit_y == 16
    z = request(engine, [70 + i for i in range(16)], 8)
    run(engine, [z], consistent)
    assert paged.preemptions == 0 and sample(engine, "stepserve_preemptions_total") == 0
    assert sample(engine, "stepserve_prefix_cache_evictions_total") == 2
    assert pool.peek(y + [1]) == hit_y  # the more recently used prefix is whole
    assert pool.peek(x + [1]) == 8  # x lost its last two blocks
    assert z.output_ids == reference(params, z.prompt_ids, 8)


def test_two_requests_in_one_prefill_row_share_a_partial_block_until_one_writes_it(params):
    """One prompt sent twice at once (one prefill row): both hold the same blocks, the partial
    last one too; the first decode step writes each one's own first token into a block of its
    own (one is a copy of the shared block made before the step), so each reads back its
    prompt and its own token, and gets the tokens it gets alone."""
    prompt = [5, 6, 7, 8, 9, 10]  # one full block and a partial one
    plain, biased = {}, {"logit_bias": ((33, 100.0),)}  # the second always picks token 33
    alone = []
    for p in (plain, biased):
        cold = make_engine(params)
        seq = request(cold, prompt, 10, **p)
        run(cold, [seq], consistent)
        alone.append(seq.output_ids)
    assert alone[0][0] != alone[1][0] == 33  # the two write different keys into their shared block

    engine = make_engine(params)
    paged = engine.paged
    assert paged is not None
    copies: list = []
    copy = engine.executor.copy_pool_blocks

    def counted(c):
        copies.extend(c)
        copy(c)

    engine.executor.copy_pool_blocks = counted  # type: ignore[method-assign]
    g, s = request(engine, prompt, 10, **plain), request(engine, prompt, 10, **biased)
    engine.submit(g)
    engine.submit(s)
    engine.step()  # both prefilled in one row and joined; the first decode step is queued
    pool = paged.blocks
    table_g, table_s = pool.block_table(id(g)), pool.block_table(id(s))
    assert table_g[0] == table_s[0]  # the full block: shared
    assert table_g[1] != table_s[1]  # the partial block: one of them writes a copy
    assert len(copies) == 1 and copies[0].src in (table_g[1], table_s[1])
    for seq, table in ((g, table_g), (s, table_s)):
        _, want = prefill_one(params, prompt + seq.output_ids[:1])  # its 7 positions, alone
        got = engine.executor.read_blocks(table[:2], 8)
        for a, b in zip(got.keys + got.values, want.keys + want.values, strict=True):
            assert mx.allclose(a[:, :, :7], b[:, :, :7], atol=1e-5), seq.output_ids[:1]
    finish(engine, [g, s], consistent)
    assert [g.output_ids, s.output_ids] == alone


def test_a_preempted_request_resumes_from_its_own_published_blocks(params):
    # 10 blocks; a and b each grow to 6: b, the later one, is preempted with ~10 tokens generated,
    # and resumes (once a ended) hitting the blocks of its prompt and of what it generated.
    engine = make_engine(params, kv_pool_tokens=10 * BT)
    a = request(engine, [20 + i for i in range(8)], 16)
    b = request(engine, [50 + i for i in range(8)], 16)
    run(engine, [a, b], consistent, steps_between=4)
    assert b.preemptions >= 1 and a.preemptions == 0
    # a and b share no block: every hit is b's resumption finding its own blocks, past its prompt
    assert sample(engine, "stepserve_prefix_cache_hit_tokens_total") > len(b.prompt_ids)
    assert final(b).cached_tokens == len(b.prompt_ids)  # usage counts the prompt's tokens only
    assert a.output_ids == reference(params, a.prompt_ids, 16)
    assert b.output_ids == reference(params, b.prompt_ids, 16)


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_read_blocks_reads_back_what_write_blocks_wrote(bits):
    """A staging cache's positions written into pool blocks (from a start block on) and read
    back: the same keys and values (through a kv_bits pool: what its quantization keeps), zeros
    past them, at the capacity asked."""
    wide = random_params(WIDE, seed=2)
    model = tiny_model(WIDE, wide)
    engine = engine_at(model, BUCKETS, kv_cache="paged", kv_block_tokens=BT, kv_pool_tokens=32 * BT, kv_bits=bits)
    ex = engine.executor
    mx.random.seed(0)
    kv = ex.alloc(1, 32)
    kv = KVCache([mx.random.normal(k.shape) for k in kv.keys], [mx.random.normal(v.shape) for v in kv.values])
    blocks = [7, 3, 12, 5, 9]  # 20 positions
    ex.write_blocks(kv, 0, blocks[:2], 8)
    ex.write_blocks(kv, 0, blocks[2:], 20, start=8)
    back = ex.read_blocks(blocks, 32)
    for got, want in zip(back.keys + back.values, kv.keys + kv.values, strict=True):
        assert got.shape == (1, WIDE.num_key_value_heads, 32, WIDE.dim_per_head) and got.dtype == mx.float32
        if bits:
            q = mx.quantize(want[:, :, :20], group_size=64, bits=bits)
            want = mx.dequantize(*q, group_size=64, bits=bits)
        assert mx.array_equal(got[:, :, :20], want[:, :, :20])
        assert not mx.any(got[:, :, 20:]).item()
