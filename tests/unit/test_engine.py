"""The engine's pipelined decode loop on a tiny random model: requests that arrive at
different times, share batches, move between buckets and stop for every reason each get
exactly the greedy tokens of their own sequence run alone, and nothing else."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from prometheus_client import CollectorRegistry

from models.loader import LoadedModel
from service.engine.buckets import BucketTable
from service.engine.core import Engine
from service.engine.executor import Executor
from service.engine.prefix_cache import PrefixCache
from service.engine.runner import ModelRunner
from service.engine.sequence import FinalEvent, FinishReason, SamplingParams, Sequence, TokenEvent
from service.engine.warmup import WarmupSpec
from service.metrics import Metrics
from tests.support import TINY, WordTokenizer, engine_at, prefill_one, random_params, start_engine

BUCKETS = BucketTable(batch=(1, 2, 4), prompt=(8, 16), capacity=(16, 24, 32))


def reference(params, prompt: list[int], max_tokens: int, stop: frozenset[int], limit: int) -> list[int]:
    """Greedy tokens of ``prompt`` run alone, step by step, with the engine's stop rules."""
    out: list[int] = []
    while True:
        logits, _ = prefill_one(params, prompt + out)
        out.append(int(mx.argmax(logits).item()))
        if out[-1] in stop or len(out) >= max_tokens or len(prompt) + len(out) - 1 >= limit:
            return out


@pytest.fixture(scope="module")
def params():
    return random_params(seed=3)


def chunking_engine(params, stop: frozenset[int], prefix_bytes: int, **settings) -> tuple[Engine, Metrics]:
    """An Engine (not started) on the tiny model prefilling in chunks of 8 tokens, 16 tokens a
    step, with a prefix cache of ``prefix_bytes`` in blocks of 4 tokens (``settings``: more
    :class:`~service.config.Settings`), and its metrics."""
    model = LoadedModel("tiny", Path("-"), TINY, params, WordTokenizer(stop), mx.float32, "dequantized", 0.0)
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    engine = engine_at(
        model,
        BUCKETS,
        metrics,
        prefill_chunk_tokens=8,
        max_batched_tokens=16,
        prefix_block_tokens=4,
        prefix_cache_bytes=prefix_bytes,
        **settings,
    )
    engine.executor.batches_chunks = True  # as on a GPU (the CPU's default runs them one by one)
    return engine, metrics


def run_engine(
    params,
    stop: frozenset[int],
    requests: list[tuple[list[int], int]],
    prefix_bytes: int = 0,
    one_at_a_time: bool = False,
    warm_batch: int = 1,
    alone_first: int = 0,
    check: Callable[[Engine], None] | None = None,
    **settings,
) -> tuple[list[tuple[list[int], FinalEvent]], Metrics]:
    """Submit ``(prompt, max_tokens)`` requests at once (or each after the previous ended; or
    the first ``alone_first`` so, then the rest at once) to a real Engine thread prefilling in
    chunks of 8 tokens, warmed for ``warm_batch`` requests, with a prefix cache of
    ``prefix_bytes`` (blocks of 4 tokens) and ``settings``; returns each request's (tokens, final
    event) and the engine's metrics. ``check``: called with the engine after each of its steps,
    on its thread (an assertion there fails the request being served)."""
    engine, metrics = chunking_engine(params, stop, prefix_bytes, **settings)
    if check is not None:
        check_each_step(engine, check)
    model = engine.model
    start_engine(engine, WarmupSpec(prompt_tokens=8, batch=warm_batch))
    assert engine.ready.wait(60)
    results: list[tuple[list[int], FinalEvent] | None] = [None] * len(requests)
    done = threading.Semaphore(0)
    seqs = []
    try:
        for i, (prompt, max_tokens) in enumerate(requests):

            def emit(event, i=i):
                if isinstance(event, FinalEvent):
                    results[i] = (list(seqs[i].output_ids), event)
                    done.release()

            seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens), model.tokenizer.detokenizer(), emit)
            seqs.append(seq)
            engine.submit(seq)
            if one_at_a_time or i < alone_first:
                assert done.acquire(timeout=60), "a request never finished"
        for _ in range(0 if one_at_a_time else len(requests) - alone_first):
            assert done.acquire(timeout=60), "a request never finished"
    finally:
        engine.stop()
    return results, metrics  # type: ignore[return-value]


def check_each_step(engine: Engine, check: Callable[[Engine], None]) -> None:
    """Have ``engine`` call ``check(engine)`` after each of its steps, on its thread."""
    step = engine.step

    def checked() -> bool:
        worked = step()
        check(engine)
        return worked

    engine.step = checked  # type: ignore[method-assign]


def sample_value(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_staggered_requests_get_their_own_greedy_tokens(params):
    limit = BUCKETS.capacity[-1]
    prompts = [
        [1, 2, 3],
        [7, 8, 9, 10, 11],
        [20, 21],
        [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41],
        [50],
        [60, 61, 62, 63],
    ]
    max_tokens = [9, 4, 30, 30, 1, 12]
    first = reference(params, prompts[0], max_tokens[0], frozenset(), limit)
    stop = frozenset({first[5]})  # the first request stops on an "EOS" mid-way; others may too
    # Two are admitted per step and four run at most (the largest batch bucket), so the last
    # two join slots that others free while the batch keeps running.
    requests = list(zip(prompts, max_tokens, strict=True))
    results, metrics = run_engine(params, stop, requests)
    for (prompt, m), (tokens, final) in zip(requests, results, strict=True):
        expected = reference(params, prompt, m, stop, limit)
        assert tokens == expected, f"prompt {prompt}: got {tokens}, alone it gives {expected}"
        assert final.completion_tokens == len(expected)
        if expected[-1] in stop:
            assert final.finish_reason is FinishReason.STOP
        else:
            assert final.finish_reason is FinishReason.LENGTH
    # The 12-token prompt asked for 30 tokens: it must stop at the largest capacity bucket.
    assert len(results[3][0]) == limit - len(prompts[3]) + 1 or results[3][0][-1] in stop
    # The rows really shared steps and the cache really moved between buckets meanwhile.
    steps = sample_value(metrics, "stepserve_batch_size_count", model="tiny", phase="decode")
    single = sample_value(metrics, "stepserve_batch_size_bucket", model="tiny", phase="decode", le="1.0")
    assert steps > single > 0, "no decode step ran more than one row"
    moves = sum(
        sample_value(metrics, "stepserve_bucket_moves_total", model="tiny", kind=k) for k in ("batch", "capacity")
    )
    assert moves >= 2


def test_a_shared_prefix_is_reused_and_changes_no_token(params):
    limit = BUCKETS.capacity[-1]
    system = list(range(40, 58))  # 18 tokens: 4 blocks of 4 are reusable
    prompts = [system + [3, 4], system + [5], system + [3, 4], list(range(60, 70))]
    requests = [(p, 6) for p in prompts]
    results, metrics = run_engine(params, frozenset(), requests, prefix_bytes=10**7, one_at_a_time=True)
    for (prompt, m), (tokens, _) in zip(requests, results, strict=True):
        assert tokens == reference(params, prompt, m, frozenset(), limit), f"prompt {prompt} changed by a cache hit"
    cached = [final.cached_tokens for _, final in results]
    # Whole blocks of 4, leaving at least the last prompt token to prefill (its logits).
    assert cached == [0, 16, 16, 0], cached
    assert sample_value(metrics, "stepserve_prefix_cache_hit_tokens_total", model="tiny") == 32
    assert sample_value(metrics, "stepserve_prefix_cache_queried_tokens_total", model="tiny") == sum(map(len, prompts))


def test_requests_sharing_a_prefix_at_once_get_their_own_tokens(params):
    limit = BUCKETS.capacity[-1]
    system = list(range(10, 30))
    requests = [(system + [i, i + 1], 5) for i in range(4)]
    results, _ = run_engine(params, frozenset(), requests, prefix_bytes=10**7)
    for (prompt, m), (tokens, _) in zip(requests, results, strict=True):
        assert tokens == reference(params, prompt, m, frozenset(), limit)


def test_prefix_hits_arriving_together_prefill_their_last_chunks_in_one_call(params, monkeypatch):
    """Hits of one shared prefix, sent at once after it is cached, run their last chunks as
    one batched call (padded to the batch bucket) from one gathered staging cache: each still
    gets its own greedy tokens."""
    calls: list[tuple[int, int]] = []
    staged: list[int] = []  # per call, the distinct staging caches its rows came from
    chunk_rows = Executor.chunk_rows

    def spy(self, kvs, tokens, offsets, lengths, batch):
        calls.append((len(kvs), batch))
        staged.append(len({id(kv.keys[0]) for kv in kvs}))
        return chunk_rows(self, kvs, tokens, offsets, lengths, batch)

    monkeypatch.setattr(Executor, "chunk_rows", spy)
    limit = BUCKETS.capacity[-1]
    system = list(range(10, 30))  # 20 tokens: 5 blocks of 4, so each hit prefills its last 2-3 tokens
    requests = [(system + [3 + 5 * i, 60 - 7 * i][: 1 + i % 2], 5) for i in range(5)]
    results, _ = run_engine(params, frozenset(), requests, prefix_bytes=10**7, warm_batch=4, alone_first=1)
    assert calls and all(b == 2 for _, b in calls), calls  # T 8: 2 rows fit the 16-token budget
    assert any(n == 2 for n, _ in calls), f"no hits' last chunks ran together: {calls}"
    for (prompt, m), (tokens, _) in zip(requests, results, strict=True):
        assert tokens == reference(params, prompt, m, frozenset(), limit), f"prompt {prompt}"
    assert [final.cached_tokens for _, final in results] == [0, 20, 20, 20, 20]
    assert any(n == 2 and k == 1 for (n, _), k in zip(calls, staged, strict=True)), "each hit gathered its own"


def test_a_prompts_blocks_are_saved_after_its_first_token_is_sent(params, monkeypatch):
    """The prefix cache's copies of a prompt's blocks are made after its first token is sent
    and the step's decode is queued (off the path to a first token), and still within that
    step: the next request sharing its prefix hits it."""
    engine, _ = chunking_engine(params, frozenset(), 10**7)
    order: list[str] = []
    insert_rows, decode_requests = PrefixCache.insert_rows, ModelRunner.decode_requests
    monkeypatch.setattr(PrefixCache, "insert_rows", lambda *a: (order.append("save"), insert_rows(*a))[1])
    monkeypatch.setattr(
        ModelRunner, "decode_requests", lambda *a, **k: (order.append("decode"), decode_requests(*a, **k))[1]
    )
    system = list(range(40, 52))  # 12 tokens: 3 blocks of 4
    finals: list[FinalEvent] = []

    def emit(event):
        if isinstance(event, TokenEvent) and "token" not in order:
            order.append("token")
        if isinstance(event, FinalEvent):
            finals.append(event)

    first = Sequence(system + [3, 4], SamplingParams(max_tokens=3), engine.model.tokenizer.detokenizer(), emit)
    engine.submit(first)
    while "token" not in order:  # the step of the last chunk
        order.clear()
        engine.step()
    assert order == ["token", "decode", "save"], order
    while not finals:
        engine.step()
    second = Sequence(system + [5], SamplingParams(max_tokens=2), engine.model.tokenizer.detokenizer(), emit)
    engine.submit(second)
    while len(finals) < 2:
        engine.step()
    assert [f.cached_tokens for f in finals] == [0, 12]


def test_a_request_cancelled_mid_prefill_frees_everything(params):
    model = LoadedModel("tiny", Path("-"), TINY, params, WordTokenizer(frozenset()), mx.float32, "dequantized", 0.0)
    engine = engine_at(model, BUCKETS, prefill_chunk_tokens=8)
    ended = threading.Event()
    finals: list[FinalEvent] = []

    def emit(event):
        if isinstance(event, FinalEvent):
            finals.append(event)
            ended.set()

    seq = Sequence(list(range(1, 25)), SamplingParams(max_tokens=4), model.tokenizer.detokenizer(), emit)
    engine.submit(seq)
    engine.step()  # its first chunk of 8
    assert 0 < seq.num_computed < len(seq.prompt_ids) and seq.staging is not None
    engine.cancel(seq)
    engine.step()
    assert ended.is_set() and finals[0].finish_reason is FinishReason.CANCELLED
    assert seq.staging is None and engine.idle and not engine.runner.busy


def test_the_rehearsal_grows_a_decoding_batch_through_each_batch_bucket(params, monkeypatch):
    """Arrivals that join a batch already decoding pad its cache with the live rows in it (a
    path with its own eager kernels, built on first use on a GPU): the warm-up rehearsal must
    take it, up through every batch bucket it warms, before the engine is ready."""
    from models.kv_cache import KVCache

    moves = []
    resized = KVCache.batch_resized

    def spy(self, batch):
        moves.append((self.batch, batch))
        return resized(self, batch)

    monkeypatch.setattr(KVCache, "batch_resized", spy)
    model = LoadedModel("tiny", Path("-"), TINY, params, WordTokenizer(frozenset()), mx.float32, "dequantized", 0.0)
    engine = engine_at(model, BUCKETS)
    start_engine(engine, WarmupSpec(prompt_tokens=8, batch=4))
    try:
        assert engine.ready.wait(60)
    finally:
        engine.stop()
    assert (1, 2) in moves and (2, 4) in moves, moves
    assert any("joining a decoding batch" in line for line in engine.rehearsed)


def test_the_rehearsal_fills_holes_in_a_decoding_batch(params, monkeypatch):
    """Requests that end leave holes; arrivals that fill them are copied into slots that are
    not consecutive (an indexed copy, not a slice: its own kernels on a GPU), as long as the
    batch stays in its bucket (8 rows, 3 ended). The rehearsal takes that path before ready."""
    from models.kv_cache import KVCache

    slot_sets = []
    insert = KVCache.insert_rows

    def spy(self, slots, src, rows, lengths):
        slot_sets.append(list(slots))
        return insert(self, slots, src, rows, lengths)

    monkeypatch.setattr(KVCache, "insert_rows", spy)
    model = LoadedModel("tiny", Path("-"), TINY, params, WordTokenizer(frozenset()), mx.float32, "dequantized", 0.0)
    metrics = Metrics(CollectorRegistry(), version="t", device="cpu")
    buckets = BucketTable(batch=(1, 8), prompt=(8, 16), capacity=(16, 24, 32))
    engine = engine_at(model, buckets, metrics)
    start_engine(engine, WarmupSpec(prompt_tokens=8, batch=8))
    try:
        assert engine.ready.wait(60)
    finally:
        engine.stop()
    assert any(s != list(range(s[0], s[0] + len(s))) for s in slot_sets), slot_sets


def test_the_rehearsal_prefills_one_prompt_sent_twice_in_one_row(params, monkeypatch):
    """Requests with the same prompt in one prefill share a row and gather their logits rows (a
    kernel of its own on a GPU, built on first use: a fresh H100's first burst of 32 essays,
    16 prompts sent twice, waited 3.6-4.5 s on it). The rehearsal builds it before ready."""
    from service.engine.prefill import Prefiller

    groups = []
    whole = Prefiller._whole

    def spy(self, group):
        groups.append([tuple(s.prompt_ids) for s in group])
        return whole(self, group)

    monkeypatch.setattr(Prefiller, "_whole", spy)
    model = LoadedModel("tiny", Path("-"), TINY, params, WordTokenizer(frozenset()), mx.float32, "dequantized", 0.0)
    metrics = Metrics(CollectorRegistry(), version="t", device="cpu")
    engine = engine_at(model, BUCKETS, metrics)
    start_engine(engine, WarmupSpec(prompt_tokens=8, batch=4))
    try:
        assert engine.ready.wait(60)
    finally:
        engine.stop()
    assert any(len(set(g)) < len(g) for g in groups), groups


def test_the_rehearsal_runs_several_prompts_last_chunks_in_one_call(params, monkeypatch):
    """The batched last chunks of prefix-cache hits arriving together (copies of each row's
    staging cache into one, eager, before the compiled call) run before ready."""
    calls = []
    chunk_rows = Executor.chunk_rows

    def spy(self, kvs, *args):
        calls.append(len(kvs))
        return chunk_rows(self, kvs, *args)

    monkeypatch.setattr(Executor, "chunk_rows", spy)
    engine, _ = chunking_engine(params, frozenset(), 10**7)
    start_engine(engine, WarmupSpec(prompt_tokens=24, batch=4, chunk_tokens=8, max_batched_tokens=16))
    try:
        assert engine.ready.wait(60), engine.not_ready_reason
    finally:
        engine.stop()
    assert any(n >= 2 for n in calls), calls


def test_the_rehearsal_fits_a_waiting_queue_shorter_than_its_bursts(params):
    """`max_waiting` 1 with 4 warmed rows: the rehearsal's waves wait for room in the queue
    instead of failing warm-up (the engine then never becomes ready)."""
    model = LoadedModel("tiny", Path("-"), TINY, params, WordTokenizer(frozenset()), mx.float32, "dequantized", 0.0)
    metrics = Metrics(CollectorRegistry(), version="t", device="cpu")
    engine = engine_at(model, BUCKETS, metrics, max_waiting=1)
    start_engine(engine, WarmupSpec(prompt_tokens=8, batch=4))
    try:
        assert engine.ready.wait(60), engine.not_ready_reason
    finally:
        engine.stop()
    assert any("sent twice" in line for line in engine.rehearsed)


# -- the paged KV pool (kv_cache = "paged") ------------------------------------------------------

STAGGERED = [
    ([1, 2, 3], 9),
    ([7, 8, 9, 10, 11], 4),
    ([20, 21], 30),
    ([30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], 30),
    ([50], 1),
    ([60, 61, 62, 63], 12),
]


def pool_is_consistent(engine: Engine) -> None:
    """After every step: the block pool's bookkeeping holds (:meth:`BlockPool.check`), each
    decoding row holds blocks for every position it has written, and an idle engine holds no
    block at all (every block is back: no leak)."""
    paged = engine.paged
    assert paged is not None
    paged.blocks.check()
    for seq in paged.live:
        assert paged.blocks.num_tokens(id(seq)) >= seq.position
    if engine.idle:
        assert paged.blocks.stats().used == 0, paged.blocks.stats()


@pytest.mark.parametrize("prefix_bytes", [0, 10**6], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("pool_tokens", [4 * 32, 40], ids=["room-for-all", "preempting"])
def test_paged_requests_get_their_own_greedy_tokens(params, pool_tokens, prefix_bytes):
    """Mixed lengths sharing batches through the paged pool, prompts prefilled in chunks: each
    request gets exactly its tokens alone. With a pool of 40 positions (one 32-token sequence and
    a few blocks more), requests are preempted mid-generation and resume from a prefill of
    prompt and output (from the prefix cache's blocks, when it is on)."""
    limit = BUCKETS.capacity[-1]
    first = reference(params, STAGGERED[0][0], STAGGERED[0][1], frozenset(), limit)
    stop = frozenset({first[5]})
    results, metrics = run_engine(
        params,
        stop,
        STAGGERED,
        prefix_bytes,
        check=pool_is_consistent,
        kv_cache="paged",
        kv_block_tokens=4,
        kv_pool_tokens=pool_tokens,
    )
    for (prompt, m), (tokens, final) in zip(STAGGERED, results, strict=True):
        expected = reference(params, prompt, m, stop, limit)
        assert tokens == expected, f"prompt {prompt}: got {tokens}, alone it gives {expected}"
        assert final.completion_tokens == len(expected)
    preempted = sample_value(metrics, "stepserve_preemptions_total", model="tiny")
    assert (preempted > 0) == (pool_tokens == 40), preempted
    steps = sample_value(metrics, "stepserve_batch_size_count", model="tiny", phase="decode")
    single = sample_value(metrics, "stepserve_batch_size_bucket", model="tiny", phase="decode", le="1.0")
    assert steps > single > 0, "no decode step ran more than one row"


def test_paged_steps_read_each_rows_own_blocks(params):
    """Through joins, a row's next blocks, batch-bucket moves, preemptions and finished
    requests, every paged decode step reads in each slot exactly the blocks its request holds
    then, in position order, with a block for the position it writes and null blocks past them,
    and null blocks throughout an empty slot (whose padded write must land in no request's block)."""
    engine, metrics = chunking_engine(params, frozenset(), 0, kv_cache="paged", kv_block_tokens=4, kv_pool_tokens=40)
    paged = engine.paged
    assert paged is not None
    start_engine(engine, WarmupSpec(prompt_tokens=8, batch=1))
    assert engine.ready.wait(60)
    decode, bt = engine.executor.decode, paged.blocks.block_tokens
    wrong: list[str] = []
    held: dict[int, list[int]] = {}  # request -> blocks per step it decoded in

    def checked(kv, tokens, positions):
        table = kv.table.tolist()
        width = kv.capacity // bt
        if len(table) != kv.batch or any(len(row) != width for row in table):
            wrong.append(f"table shape {kv.table.shape} at bucket ({kv.batch}, {kv.capacity})")
        slots = paged.slots + [None] * (kv.batch - len(paged.slots))
        for slot, (seq, row) in enumerate(zip(slots, table, strict=True)):
            blocks = paged.blocks.block_table(id(seq)) if seq is not None else []
            if row != blocks + [0] * (width - len(blocks)):
                wrong.append(f"slot {slot}: table row {row}, request holds {blocks}")
            if seq is not None:
                held.setdefault(seq.order, []).append(len(blocks))
                if positions[slot] >= len(blocks) * bt:
                    wrong.append(f"slot {slot}: position {positions[slot]} past its blocks {blocks}")
        return decode(kv, tokens, positions)

    engine.executor.decode = checked  # type: ignore[method-assign]
    done = threading.Semaphore(0)
    finals: list[FinalEvent] = []

    def emit(event):
        if isinstance(event, FinalEvent):
            finals.append(event)
            done.release()

    try:
        for prompt, max_tokens in STAGGERED:
            engine.submit(
                Sequence(prompt, SamplingParams(max_tokens=max_tokens), engine.model.tokenizer.detokenizer(), emit)
            )
        for _ in STAGGERED:
            assert done.acquire(timeout=60), "a request never finished"
    finally:
        engine.stop()
    assert not wrong, wrong[:5]
    assert all(f.finish_reason is FinishReason.LENGTH for f in finals), finals
    assert sample_value(metrics, "stepserve_preemptions_total", model="tiny") > 0
    assert any(len(set(counts)) > 1 for counts in held.values()), "no row took a block while decoding"
    steps = sample_value(metrics, "stepserve_batch_size_count", model="tiny", phase="decode")
    single = sample_value(metrics, "stepserve_batch_size_bucket", model="tiny", phase="decode", le="1.0")
    assert steps > single > 0, "no step ran more than one row, or none ran one alone"


def test_paged_pool_decodes_plain_without_a_paged_verify_and_refuses_off_block_buckets(params, monkeypatch):
    from models import llama

    model = LoadedModel("tiny", Path("-"), TINY, params, WordTokenizer(frozenset()), mx.float32, "dequantized", 0.0)
    settings = {"kv_cache": "paged", "kv_pool_tokens": 64, "kv_block_tokens": 4, "speculative": "lookup"}
    assert engine_at(model, BUCKETS, **settings).speculator is not None
    monkeypatch.delattr(llama, "verify_paged")  # a family with a paged decode and no paged verify
    assert engine_at(model, BUCKETS, **settings).speculator is None  # it decodes plain on the pool
    with pytest.raises(ValueError, match="multiple of kv_block_tokens"):
        engine_at(model, BUCKETS, kv_cache="paged", kv_pool_tokens=64, kv_block_tokens=5)


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_a_request_joins_beside_a_row_whose_last_token_at_the_capacity_limit_is_in_flight(params, kv_cache):
    """A row that reached the largest capacity has its last token in flight (the runner
    vacates it before the next step); a request joining meanwhile re-buckets the batch without
    room past the limit for it (that took a capacity bucket beyond the largest and failed the
    step), and both get their tokens alone."""
    settings = {"kv_cache": kv_cache, **({"kv_block_tokens": 4, "kv_pool_tokens": 128} if kv_cache == "paged" else {})}
    engine, _ = chunking_engine(params, frozenset(), 0, **settings)
    limit = BUCKETS.capacity[-1]
    a = Sequence(
        list(range(20, 40)), SamplingParams(max_tokens=100), engine.model.tokenizer.detokenizer(), lambda e: None
    )
    b = Sequence([5, 6, 7], SamplingParams(max_tokens=3), engine.model.tokenizer.detokenizer(), lambda e: None)
    engine.submit(a)
    while a.position < limit:
        engine.step()
    assert a.finish_reason is None  # its last token is in flight
    engine.submit(b)
    while a.finish_reason is None or b.finish_reason is None or engine.runner.busy:
        engine.step()
    for seq in (a, b):
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.output_ids == reference(params, seq.prompt_ids, seq.params.max_tokens, frozenset(), limit)


def test_paged_fuzz_of_arrivals_cancellations_and_lengths_leaks_no_block(params):
    """40 requests of random lengths arrive at random times against a pool of 48 positions
    (prefix cache on), a third of them starting with one of two 12-token prefixes (a request may
    then wait for one in flight), and a fifth are cancelled at random: each finished request has
    its tokens alone (a cancelled one a prefix of them), the pool's bookkeeping (its pending
    blocks included) holds after every step and once idle every block is back."""
    import random

    rng = random.Random(7)
    limit = BUCKETS.capacity[-1]
    engine, metrics = chunking_engine(
        params, frozenset(), 10**6, kv_cache="paged", kv_block_tokens=4, kv_pool_tokens=48
    )
    check_each_step(engine, pool_is_consistent)
    start_engine(engine, WarmupSpec(prompt_tokens=8, batch=1))
    assert engine.ready.wait(60)
    finals: dict[int, FinalEvent] = {}
    done = threading.Semaphore(0)
    seqs: list[Sequence] = []
    try:
        heads = [[rng.randrange(1, 90) for _ in range(12)] for _ in range(2)]
        for i in range(40):
            prompt = [rng.randrange(1, 90) for _ in range(rng.randint(1, 20))]
            if rng.random() < 0.3:
                prompt = rng.choice(heads) + prompt[:8]

            def emit(event, i=i):
                if isinstance(event, FinalEvent):
                    finals[i] = event
                    done.release()

            seq = Sequence(
                prompt, SamplingParams(max_tokens=rng.randint(1, 25)), engine.model.tokenizer.detokenizer(), emit
            )
            seqs.append(seq)
            engine.submit(seq)
            if rng.random() < 0.2:
                engine.cancel(seqs[rng.randrange(len(seqs))])
            if rng.random() < 0.3:
                done.acquire(timeout=60)
                done.release()
        for _ in range(40):
            assert done.acquire(timeout=120), "a request never finished"
        deadline = threading.Event()
        while not engine.idle and not deadline.wait(0.05):
            pass
        assert engine.paged is not None and engine.paged.blocks.stats().used == 0
    finally:
        engine.stop()
    assert engine.paged.blocks.stats().used == 0
    for i, seq in enumerate(seqs):
        expected = reference(params, seq.prompt_ids, seq.params.max_tokens, frozenset(), limit)
        if finals[i].finish_reason is FinishReason.CANCELLED:
            assert seq.output_ids == expected[: len(seq.output_ids)]
        else:
            assert finals[i].finish_reason is FinishReason.LENGTH, finals[i]
            assert seq.output_ids == expected, f"request {i}"
    assert sample_value(metrics, "stepserve_preemptions_total", model="tiny") > 0
