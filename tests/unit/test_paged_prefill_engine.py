"""Prompts prefilled straight into their pool blocks (``kv_cache = "paged"``, a hand-written
family): the engine, stepped on this thread on a tiny random model, never copies a staging cache
into blocks (``write_blocks``) nor a prefix hit's blocks out of them (``read_blocks``) and never
runs a staging step, yet every request gets the tokens it gets alone (those of the static
cache): short prompts whole, long ones in chunks, a prefix hit's remainder, several prompts'
last chunks in one call, preempted requests resuming; the pool's bookkeeping holds after every
step and no block is left held; warmed up, no step compiles after ready. A ``kv_bits`` pool
prefills in its blocks too (a preempted request then resumes on the quantized keys its decode
steps attended); pipeline stages and mlx-lm's classes keep the staging path."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, cast

from models.adapter import AdapterArgs
from service.engine.executor import prefills_in_blocks
from service.engine.warmup import WarmupSpec, plan
from tests.support import random_params, start_engine
from tests.unit.test_paged_prefix import (
    BT,
    PREFIX,
    WIDE,
    consistent,
    final,
    finish,
    make_engine,
    params,  # noqa: F401  (the module's fixture)
    reference,
    request,
    run,
    sample,
    tiny_model,
)


def no_staging(engine) -> list[tuple[int, int]]:
    """Make every staging-path operation fail the test, and record each
    :meth:`Executor.prefill_blocks` call's (rows, batch bucket)."""
    executor = engine.executor
    assert executor.in_blocks and engine.prefiller.in_blocks

    def refuse(name: str):
        def call(*args: Any, **kwargs: Any):
            raise AssertionError(f"{name} ran: prompts prefill in their blocks")

        return call

    for name in ("write_blocks", "read_blocks", "prefill", "chunk", "chunk_rows", "alloc"):
        setattr(executor, name, refuse(name))
    calls: list[tuple[int, int]] = []
    prefill_blocks = executor.prefill_blocks

    def counted(tables, tokens, offsets, lengths, batch, capacity=0):
        calls.append((len(tokens), batch))
        return prefill_blocks(tables, tokens, offsets, lengths, batch, capacity)

    executor.prefill_blocks = counted
    return calls


def test_whole_prompts_chunks_and_a_prefix_hits_remainder_prefill_in_their_blocks(params):  # noqa: F811
    engine = make_engine(params)
    calls = no_staging(engine)
    short, mid, long = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [40 + i for i in range(30)]
    seqs = [request(engine, p, 8) for p in (short, mid, long)]
    run(engine, seqs, consistent, steps_between=1)  # staggered: joins while others decode
    for seq, prompt in zip(seqs, (short, mid, long), strict=True):
        assert seq.output_ids == reference(params, prompt, 8), prompt
    assert any(n > 1 for n, _ in calls) or len(calls) >= 6  # whole prompts and the long one's 4 chunks
    first = request(engine, PREFIX + [91, 92, 93], 6)
    run(engine, [first], consistent)
    hit = request(engine, PREFIX + [94, 95], 6)
    run(engine, [hit], consistent)
    assert final(hit).cached_tokens == len(PREFIX)
    assert hit.output_ids == reference(params, PREFIX + [94, 95], 6)
    assert engine.paged is not None and engine.paged.blocks.stats().used == 0


def test_prefix_hits_arriving_together_prefill_their_last_chunks_in_one_call_in_their_blocks(params):  # noqa: F811
    engine = make_engine(params, max_batched_tokens=32)
    engine.executor.batches_chunks = True  # as on a GPU: several prompts' last chunks in one call
    calls = no_staging(engine)
    run(engine, [request(engine, PREFIX + [90], 2)], consistent)
    tails = [[91, 92], [93, 94, 95], [96]]
    hits = [request(engine, PREFIX + t, 6) for t in tails]
    calls.clear()
    run(engine, hits, consistent)
    assert calls[0] == (3, 4), calls  # three rows at batch bucket 4: one call
    for seq, tail in zip(hits, tails, strict=True):
        assert final(seq).cached_tokens == len(PREFIX)
        assert seq.output_ids == reference(params, PREFIX + tail, 6), tail


def test_preempted_requests_resume_prefilling_in_their_blocks_and_leak_nothing(params):  # noqa: F811
    engine = make_engine(params, kv_pool_tokens=10 * BT)
    no_staging(engine)
    a = request(engine, [20 + i for i in range(8)], 16)
    b = request(engine, [50 + i for i in range(8)], 16)
    c = request(engine, [70 + i for i in range(13)], 6)  # chunked, arriving while the pool is full
    run(engine, [a, b, c], consistent, steps_between=4)
    assert b.preemptions >= 1
    assert sample(engine, "stepserve_preemptions_total") >= 1
    for seq in (a, b, c):
        assert seq.output_ids == reference(params, seq.prompt_ids, len(seq.output_ids)), seq.prompt_ids
    assert engine.paged is not None and engine.paged.blocks.stats().used == 0


def test_a_kv_bits_request_preempted_and_resumed_gets_the_tokens_it_gets_alone():
    """``kv_bits`` 8 in blocks: a resumed request's prompt and sent tokens are prefilled again
    into its blocks, quantized as written, and its chunk attends over them quantized, as its
    decode steps did; so it goes on with the tokens it gets run alone (with the staging path it
    re-attended them at full precision and could drift)."""
    wide = random_params(WIDE, seed=3)

    def kv_bits_engine(pool_tokens: int):
        return make_engine(wide, args=WIDE, kv_bits=8, kv_pool_tokens=pool_tokens)

    engine = kv_bits_engine(10 * BT)
    no_staging(engine)
    a = request(engine, [20 + i for i in range(8)], 16)
    b = request(engine, [50 + i for i in range(8)], 16)
    c = request(engine, [70 + i for i in range(13)], 6)
    run(engine, [a, b, c], consistent, steps_between=4)
    assert b.preemptions >= 1
    for seq in (a, b, c):
        alone = kv_bits_engine(256)
        again = request(alone, seq.prompt_ids, len(seq.output_ids))
        run(alone, [again], consistent)
        assert seq.output_ids == again.output_ids, seq.prompt_ids
    assert engine.paged is not None and engine.paged.blocks.stats().used == 0


def test_a_request_cancelled_mid_prefill_gives_its_unwritten_blocks_back_unpublished(params):  # noqa: F811
    engine = make_engine(params)
    no_staging(engine)
    long = request(engine, [40 + i for i in range(30)], 4)
    engine.submit(long)
    engine.step()  # its first chunk is in its blocks
    assert 0 < long.num_computed < len(long.prompt_ids)
    written = long.num_computed // BT  # its first chunk's full blocks: published once read back
    engine.cancel(long)
    finish(engine, [long], consistent)
    assert engine.paged is not None
    assert engine.paged.blocks.stats().used == 0 and engine.paged.blocks.stats().cached == written
    again = request(engine, long.prompt_ids, 4)
    run(engine, [again], consistent)
    assert final(again).cached_tokens == written * BT
    assert again.output_ids == reference(params, long.prompt_ids, 4)


def test_warmed_up_no_prefill_in_blocks_compiles_after_ready(params):  # noqa: F811
    """The warm-up plan's prefill and chunk keys are the ones prompts prefilled in blocks reach:
    a short prompt, a chunked one and a prefix hit's remainder after ready miss no compiled step."""
    engine = make_engine(params)
    engine.ready.clear()
    spec = WarmupSpec(prompt_tokens=40, batch=2, chunk_tokens=8, max_batched_tokens=16)
    start_engine(engine, spec)
    try:
        assert engine.ready.wait(300), engine.not_ready_reason
        no_staging(engine)
        before = prefill_keys(engine)
        assert any(k.phase == "chunk" for k in before) and any(k.phase == "prefill" for k in before)
        first = request(engine, PREFIX + [91], 4)
        engine.submit(first)
        wait_for(first)
        seqs = [request(engine, p, 4) for p in ([3, 1, 4], [40 + i for i in range(30)], PREFIX + [92, 93])]
        for seq in seqs:
            engine.submit(seq)
        for seq in seqs:
            wait_for(seq)
    finally:
        engine.stop()
    assert final(seqs[2]).cached_tokens == len(PREFIX)
    assert prefill_keys(engine) == before  # a key first met after ready would be new (and run eagerly)
    planned = set(plan(engine.buckets, spec))  # and the plan itself holds every key met, rehearsal's too
    assert {(k.phase, k.batch, k.size, k.capacity) for k in before} <= planned
    for seq in seqs:
        assert seq.output_ids == reference(params, seq.prompt_ids, 4), seq.prompt_ids


def prefill_keys(engine) -> set:
    """The compile cache's prefill and chunk keys so far (warmed or met)."""
    return {k for k in engine.executor.compiled.choices() if k.phase in ("prefill", "chunk")}


def wait_for(seq) -> None:
    """Until ``seq`` has ended (the engine runs on its thread); fails after two minutes."""
    deadline = time.monotonic() + 120
    while seq.finish_reason is None:
        assert time.monotonic() < deadline, "the request never finished"
        time.sleep(0.02)


def test_pipeline_stages_and_mlx_lm_classes_keep_the_staging_path(params):  # noqa: F811
    model = tiny_model(WIDE, params)
    assert prefills_in_blocks(model, None)
    assert prefills_in_blocks(model, 8)  # a kv_bits pool too: its chunks attend over their keys quantized
    assert not prefills_in_blocks(dataclasses.replace(model, stage=range(0, 1)), None)
    assert not prefills_in_blocks(dataclasses.replace(model, group=cast(Any, object())), None)
    assert not prefills_in_blocks(dataclasses.replace(model, args=object.__new__(AdapterArgs)), None)
