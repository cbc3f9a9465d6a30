"""Requests sharing a long prefix that arrive together with the paged KV pool (issue #28): the
first one computes the shared blocks and the others wait at the head of the queue until they are
published, then are admitted with a prefix hit on them, so the shared prefix is prefilled and
held once, not once per request. Where prompts prefill in their blocks the owner publishes its
full blocks chunk by chunk; on the staging path at join. An owner cancelled or preempted
mid-prefill drops its pending blocks, and the waiting requests compute them themselves: every
request still gets its tokens alone, no block leaks and nothing hangs. The engine is stepped on
this thread on a tiny random model (:mod:`tests.unit.test_paged_prefix`'s)."""

from __future__ import annotations

import pytest

from service.engine import executor as executor_module
from service.engine.buckets import BucketTable
from service.engine.core import Engine
from tests.support import random_params
from tests.unit.test_paged_prefix import (
    BT,
    PREFIX,
    WIDE,
    consistent,
    final,
    finish,
    params,  # noqa: F401  (the module's fixture)
    reference,
    request,
)
from tests.unit.test_paged_prefix import make_engine as paged_engine

#: Room for the six requests running at once (batch bucket 8).
BUCKETS = BucketTable(batch=(1, 2, 4, 8), prompt=(8, 16), capacity=(32, 64))
N = 6
MAX_TOKENS = 4
TAILS = [[90 + i, 60 + i] for i in range(N)]  # 38-token prompts: PREFIX's 9 full blocks, a partial one
SHARED = len(PREFIX) // BT  # 9 blocks
STEPS = 120  # far more than the burst needs: a request still waiting then would be a hang


def make_engine(params, in_blocks: bool, monkeypatch, **settings) -> Engine:  # noqa: F811
    """:func:`tests.unit.test_paged_prefix.make_engine` with batches of up to 8, whose prompts
    prefill in their blocks, or (``in_blocks`` False) on staging caches copied into their
    blocks at join, as mlx-lm's classes and pipeline stages do."""
    if not in_blocks:
        monkeypatch.setattr(executor_module, "prefills_in_blocks", lambda model, bits: False)
    engine = paged_engine(params, buckets=BUCKETS, **settings)
    if engine.paged is not None:
        assert engine.executor.in_blocks is in_blocks and engine.prefiller.in_blocks is in_blocks
    return engine


def peak_blocks(engine: Engine) -> list[int]:
    """Record the pool's blocks in use after every allocation and growth (the most it held)."""
    assert engine.paged is not None
    pool, peak = engine.paged.blocks, [0]
    for name in ("allocate", "append_slots"):
        method = getattr(pool, name)

        def counted(*args, method=method, **kwargs):
            out = method(*args, **kwargs)
            peak[0] = max(peak[0], pool.stats().used)
            return out

        setattr(pool, name, counted)
    return peak


def bounded(engine: Engine, seqs, steps: int = STEPS) -> None:
    """:func:`finish` ``seqs``, failing after ``steps`` engine steps (a hang)."""
    count = [0]

    def check(engine: Engine) -> None:
        consistent(engine)
        count[0] += 1
        assert count[0] <= steps, [s.finish_reason for s in seqs]

    finish(engine, seqs, check)
    assert engine.paged is not None and not engine.paged.blocks._pending


@pytest.mark.parametrize("in_blocks", [True, False], ids=["in-blocks", "staging"])
def test_requests_sharing_a_prefix_arriving_together_prefill_and_hold_it_once(params, in_blocks, monkeypatch):  # noqa: F811
    """Six requests sharing a 36-token prefix (9 blocks) sent at once: the first prefills it,
    the other five wait and then hit all of it; the pool never holds more than the prefix once
    plus each request's own blocks, and every request gets its tokens alone (and the static
    cache's)."""
    engine = make_engine(params, in_blocks, monkeypatch)
    peak = peak_blocks(engine)
    seqs = [request(engine, PREFIX + tail, MAX_TOKENS) for tail in TAILS]
    for seq in seqs:
        engine.submit(seq)
    bounded(engine, seqs)
    assert final(seqs[0]).cached_tokens == 0
    for seq in seqs[1:]:
        assert final(seq).cached_tokens == SHARED * BT
    # The 9 shared blocks once, and each request's own: its partial prompt block and the block
    # its generated tokens reach (38 + 4 positions: 11 blocks), against 6 x 11 = 66 unshared.
    own = engine.paged.blocks.blocks_for(len(PREFIX) + 2 + MAX_TOKENS) - SHARED  # type: ignore[union-attr]
    assert own == 2
    assert peak[0] <= SHARED + N * own == 21, peak[0]

    static = make_engine(params, True, monkeypatch, kv_cache="static", kv_pool_tokens=None, prefix_block_tokens=BT)
    burst = [request(static, PREFIX + tail, MAX_TOKENS) for tail in TAILS]
    for seq in burst:
        static.submit(seq)
    finish(static, burst)
    for seq, alone in zip(seqs, burst, strict=True):
        expected = reference(params, seq.prompt_ids, MAX_TOKENS)
        assert seq.output_ids == alone.output_ids == expected, seq.prompt_ids


@pytest.mark.parametrize("in_blocks", [True, False], ids=["in-blocks", "staging"])
@pytest.mark.parametrize("how", ["cancelled", "preempted"])
def test_an_owner_that_stops_mid_prefill_leaves_the_waiting_requests_to_compute_the_prefix(
    params,  # noqa: F811
    in_blocks,
    how,
    monkeypatch,
):
    """The owner, two chunks into the shared prefix, is cancelled (it ends) or preempted (its
    blocks taken back, it resumes first): its pending blocks go with it, and the next request
    computes what was not published (where prompts prefill in blocks the owner's first two
    chunks were: a hit of 16 tokens), the others then hit all of the shared prefix."""
    engine = make_engine(params, in_blocks, monkeypatch)
    seqs = [request(engine, PREFIX + tail, MAX_TOKENS) for tail in TAILS]
    owner, first, *rest = seqs
    for seq in seqs:
        engine.submit(seq)
    engine.step()
    engine.step()
    assert owner.num_computed == 16 and first.started is None  # the others wait for it
    assert engine.paged is not None and engine.paged.blocks.pending(first.prompt_ids) > 0
    if how == "cancelled":
        engine.cancel(owner)
    else:
        engine._preempt(owner)
        assert not engine.paged.blocks.pending(first.prompt_ids)
    bounded(engine, seqs)
    published = 16 if in_blocks else 0
    if how == "cancelled":
        assert final(owner).finish_reason.value == "cancelled"
        assert final(first).cached_tokens == published
    else:
        assert owner.preemptions == 1 and final(owner).cached_tokens == published  # it resumed first
        assert final(first).cached_tokens == SHARED * BT
    for seq in rest:
        assert final(seq).cached_tokens == SHARED * BT
    for seq in seqs[1:] if how == "cancelled" else seqs:
        assert seq.output_ids == reference(params, seq.prompt_ids, MAX_TOKENS), seq.prompt_ids
    assert engine.paged.blocks.stats().used == 0


def test_a_prefix_shared_by_short_prompts_is_not_waited_for(params, monkeypatch):  # noqa: F811
    """Prompts whose shared prefix is less than a chunk prefill together in one step (waiting
    would cost a step to save less than a chunk's work): none is deferred."""
    engine = make_engine(params, True, monkeypatch)
    head = PREFIX[:4]  # one block
    seqs = [request(engine, head + [90 + i], 3) for i in range(3)]
    for seq in seqs:
        engine.submit(seq)
    engine.step()
    assert all(s.output_ids for s in seqs)  # all three prefilled in the first step
    bounded(engine, seqs)
    for seq in seqs:
        assert seq.output_ids == reference(params, seq.prompt_ids, 3)


@pytest.mark.parametrize("in_blocks", [True, False], ids=["in-blocks", "staging"])
def test_stepped_fuzz_of_shared_prefixes_arrivals_cancellations_and_a_tiny_pool(params, in_blocks, monkeypatch):  # noqa: F811
    """Random bursts of arrivals (most sharing one of three 16-token prefixes, two chunks), random
    cancellations and lengths against a pool of 12 blocks, the engine stepped on this thread:
    requests are deferred for a prefix in flight and others preempted, yet the pool's
    bookkeeping (the pending map included) holds after every step, every request that was not
    cancelled gets its tokens alone (a cancelled one a prefix of them), nothing hangs and once
    idle no block is held."""
    import random

    rng = random.Random(11)
    engine = make_engine(params, in_blocks, monkeypatch, kv_pool_tokens=12 * BT)
    fits, deferred = engine.scheduler.fits, []

    def counted(seq) -> bool:  # a request kept waiting for a prefix in flight, not for blocks
        ok = fits(seq)
        assert engine.paged is not None
        pool, ids = engine.paged.blocks, seq.prefill_ids
        reserve = pool.blocks_for(len(ids) + 1) - pool.blocks_for(len(ids)) + engine.scheduler.num_running
        if not ok and pool.pending(ids) and pool.can_allocate(ids, reserve):
            deferred.append(seq)
        return ok

    engine.scheduler.fits = counted
    heads = [PREFIX[i : i + 16] for i in (0, 10, 20)]
    seqs = []
    for _ in range(200):
        if len(seqs) < 30 and rng.random() < 0.35:  # a burst of 1 to 3, sharing a head or not
            head = rng.choice(heads) if rng.random() < 0.6 else []
            for _ in range(rng.randint(1, 3)):
                tail = [rng.randrange(1, 90) for _ in range(rng.randint(1, 10))]
                seqs.append(request(engine, head + tail, rng.randint(1, 20)))
                engine.submit(seqs[-1])
        if seqs and rng.random() < 0.1:
            engine.cancel(rng.choice(seqs))
        engine.step()
        consistent(engine)
    bounded(engine, seqs, steps=400)
    assert engine.paged is not None
    assert len(deferred) > 0 and engine.paged.preemptions > 0, (len(deferred), engine.paged.preemptions)
    for seq in seqs:
        expected = reference(params, seq.prompt_ids, seq.params.max_tokens)
        if final(seq).finish_reason.value == "cancelled":
            assert seq.output_ids == expected[: len(seq.output_ids)]
        else:
            assert seq.output_ids == expected, seq.prompt_ids


def test_a_kv_bits_pool_waits_for_a_prefix_in_flight_too():
    """A ``kv_bits`` pool (prefilled in its blocks, quantized as written): the burst's later requests
    hit the first one's blocks, the pool holds the prefix once, and each gets the tokens it gets
    sent after the first one ended (the same quantized blocks, hit)."""
    wide = random_params(WIDE, seed=2)

    def kv_bits_engine() -> Engine:
        engine = paged_engine(wide, args=WIDE, buckets=BUCKETS, kv_bits=8)
        assert engine.executor.in_blocks
        return engine

    engine = kv_bits_engine()
    peak = peak_blocks(engine)
    seqs = [request(engine, PREFIX + tail, MAX_TOKENS) for tail in TAILS]
    for seq in seqs:
        engine.submit(seq)
    bounded(engine, seqs)
    assert [final(s).cached_tokens for s in seqs] == [0] + [SHARED * BT] * (N - 1)
    assert peak[0] <= SHARED + N * 2, peak[0]
    one_by_one = kv_bits_engine()
    for seq in seqs:
        again = request(one_by_one, seq.prompt_ids, MAX_TOKENS)
        one_by_one.submit(again)
        bounded(one_by_one, [again])
        assert again.output_ids == seq.output_ids, seq.prompt_ids
