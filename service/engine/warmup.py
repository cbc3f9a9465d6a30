"""Warm-up: which buckets to compile before the server says it is ready, and the dummy
inputs each step is run on."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from service.engine.buckets import BucketTable
from service.engine.prefill import last_chunk_rows
from service.engine.scheduler import QueueFullError
from service.engine.sequence import SamplingParams, Sequence

if TYPE_CHECKING:
    from service.engine.core import Engine
    from service.engine.executor import Executor
    from service.engine.runner import ModelRunner

log = logging.getLogger("stepserve.engine")


@dataclass(frozen=True)
class WarmupSpec:
    """What to compile before serving.

    Attributes:
        prompt_tokens: prompts of up to this many tokens (chunks and whole prefills alike);
            0 warms nothing.
        batch: up to this many concurrent requests (decode batch buckets, whole-prefill rows).
        batched_positions: batches of more than one row reach the capacity buckets holding
            this many positions (a lone request: every capacity bucket); None: all.
        chunk_tokens: the engine's prefill chunk (prompt tokens per request per step).
        max_batched_tokens: the engine's token budget per step (bounds whole-prefill rows).
        rehearse: also run a few dummy requests through the engine's own step, to build the
            eager paths (slot inserts, bucket moves, prefix-cache copies) before ready.
        batched_chunks: prompts' last chunks of one (T, C) bucket run together, at (B, T, C)
            (:meth:`Executor.chunk_rows`; a pipeline group's leader runs them one by one).
    """

    prompt_tokens: int = 512
    batch: int = 1
    batched_positions: int | None = None
    chunk_tokens: int = 512
    max_batched_tokens: int = 2048
    rehearse: bool = True
    batched_chunks: bool = True


Step = tuple[str, int, int, int]  # (phase, batch, size, capacity): a compile-cache key's buckets


def warmed_batch(buckets: BucketTable, spec: WarmupSpec) -> int:
    """The batch bucket warm-up covers: that of ``spec.batch`` concurrent requests (at most the
    largest batch bucket)."""
    return buckets.batch_for(min(spec.batch, buckets.batch[-1]))


def plan(buckets: BucketTable, spec: WarmupSpec) -> list[Step]:
    """Every step function a request within ``spec`` can reach, so none compiles after ready:

    * ``prefill`` (B, T): prompts of up to ``chunk_tokens`` tokens prefilled whole, B the rows
      of one prompt bucket one call runs (at most the step's token budget of padded tokens;
      ``batch`` bounds them too);
    * ``chunk`` (1, T, C): a longer prompt's chunks, and what follows a prefix-cache hit, at
      every chunk bucket T and every staging capacity C >= T the prompts reach
      (:meth:`BucketTable.staging_for`); with ``batched_chunks``, also (B, T, C) for the one
      batch bucket B per chunk bucket that the last chunks of several prompts run at together
      (:func:`service.engine.prefill.last_chunk_rows`);
    * ``decode`` (B, C): batch 1 at every capacity bucket, larger batches up to ``batch`` at the
      capacities of ``batched_positions``;
    * the sampler, the logits processors and the logprobs of every batch bucket above, and the
      shapeless greedy step.
    """
    if spec.prompt_tokens <= 0:
        return []
    limit = buckets.capacity[-1]
    chunk_top = buckets.prompt_for(min(spec.chunk_tokens, buckets.prompt[-1]))
    chunk_ts = [t for t in buckets.prompt if t <= chunk_top]
    whole_ts = [t for t in chunk_ts if t <= buckets.prompt_for(min(spec.prompt_tokens, chunk_top))]
    rows = warmed_batch(buckets, spec)
    whole_tokens = max(spec.max_batched_tokens, spec.chunk_tokens)  # padded tokens of one whole prefill
    prefill = []
    for i, t in enumerate(whole_ts):
        shortest = (chunk_ts[i - 1] + 1) if i else 1  # a prompt in bucket t has at least this many tokens
        admitted = max(1, min(rows, spec.max_batched_tokens // shortest))
        most = min(buckets.batch_for(admitted), buckets.prefill_rows(t, whole_tokens))
        prefill += [("prefill", b, t, 0) for b in buckets.batch if b <= most]
    staging_top = buckets.staging_for(min(spec.prompt_tokens + 1, limit))
    stagings = sorted({buckets.staging_for(c) for c in buckets.capacity if c <= staging_top})
    chunks = [("chunk", 1, t, c) for c in stagings for t in chunk_ts if t <= c]
    if spec.batched_chunks:
        last = {t: last_chunk_rows(buckets, t, whole_tokens, rows) for t in chunk_ts}
        chunks += [("chunk", last[t], t, c) for c in stagings for t in chunk_ts if t <= c and last[t] > 1]
    batched_top = limit if spec.batched_positions is None else buckets.capacity_for(min(spec.batched_positions, limit))
    decode = [
        ("decode", b, c, 0) for b in buckets.batch if b <= rows for c in buckets.capacity if b == 1 or c <= batched_top
    ]
    batches = sorted({b for _, b, _, _ in prefill + chunks + decode})
    samplers = [(phase, b, 0, 0) for phase in ("sample", "process", "logprobs") for b in batches]
    return prefill + chunks + decode + samplers + [("greedy", 0, 0, 0)]


def dummy_inputs(executor: Executor, phase: str, batch: int, size: int, capacity: int = 0) -> tuple:
    """Arguments of ``phase``'s step function at bucket (batch, size[, capacity]): zero tokens,
    positions and offsets, lengths of 1, a zeroed KV cache (of this process's layers), zero
    logits and keys, no seeded rows."""
    params, vocab = executor.model.params, executor.vocab
    if phase == "chunk":
        zeros, ones = mx.zeros((batch,), mx.int32), mx.ones((batch,), mx.int32)
        return params, mx.zeros((batch, size), mx.int32), zeros, ones, executor.new_kv(batch, capacity)
    if phase == "prefill":
        return params, mx.zeros((batch, size), mx.int32), mx.ones((batch,), mx.int32), executor.new_kv(batch, size)
    if phase == "decode":
        zeros = mx.zeros((batch,), mx.int32)
        return params, zeros, zeros, executor.new_kv(batch, size, ring=True)
    if phase == "greedy":
        return (mx.zeros((1, vocab), mx.float32),)
    ones, logits = mx.ones((batch,), mx.float32), mx.zeros((batch, vocab), mx.float32)
    if phase == "process":
        allowed = mx.full((batch, (vocab + 31) // 32), -1, mx.int32)
        return logits, logits, allowed, ones, mx.zeros((batch, vocab), mx.bool_)
    if phase == "logprobs":
        return logits, mx.zeros((batch,), mx.int32)
    keys, no_min_p = mx.zeros((batch, 2), mx.uint32), mx.zeros((batch,), mx.float32)
    return logits, ones, ones, mx.full((batch,), vocab, mx.int32), no_min_p, keys, mx.zeros((batch,), mx.bool_)


def run(runner: ModelRunner, steps: list[Step], progress: Callable[[int, str], None] | None = None) -> float:
    """Warm every step of ``steps`` (logging each with its time) and return the seconds taken."""
    start = time.perf_counter()
    for i, (phase, b, size, capacity) in enumerate(steps):
        t0 = time.perf_counter()
        compiled = runner.warm(phase, b, size, capacity)
        label = f"{phase} b{b}" + (f"x{size}" if size else "") + (f"c{capacity}" if capacity else "") if b else phase
        how = "compiled" if compiled else "eager"
        log.info("warm-up %d/%d: %s ready in %.2f s, runs %s", i + 1, len(steps), label, time.perf_counter() - t0, how)
        if progress:
            progress(len(steps), label)
    return time.perf_counter() - start


def rehearse(engine: Engine, spec: WarmupSpec) -> list[str]:
    """Run dummy requests through ``engine.step()`` before ready, so the paths built eagerly on
    first use — slot inserts, batch moves down and up (arrivals joining a decoding batch: the
    cache padded with live rows), one prompt sent twice (a gather of logits rows), capacity
    moves, chunked prefill, prefix-cache copies, seeded sampling — are built now rather than
    under the first requests (:func:`rehearsal_scenarios`).

    Runs on the engine thread, before it serves; the requests are marked ``warmup`` (no
    metrics) and the prefix cache is emptied afterwards. Returns what ran, one line each.
    """
    runner = engine.runner
    scenarios = rehearsal_scenarios(engine, spec)
    if runner.speculator is not None:  # verify steps (forced on: what they build is built whatever warm-up measured)
        runner.speculator.forced = True
    done = []
    for name, waves in scenarios.items():
        _run_waves(engine, waves)
        done.append(name)
        log.info("warm-up rehearsal: %s", name)
    forget_prefixes(engine)
    if runner.speculator is not None:
        runner.speculator.forced = False
    return done


def rehearsal_scenarios(engine: Engine, spec: WarmupSpec) -> dict[str, list[list[Sequence]]]:
    """The rehearsal's scenarios, by what each exercises: each a list of waves of dummy
    requests (``warmup`` set; token ids spread over the vocabulary), a wave submitted once the
    one before it is decoding. Sized by ``spec`` (batch, prompt and chunk tokens) within the
    engine's buckets and running limit."""
    buckets, runner = engine.buckets, engine.runner
    vocab, limit = engine.model.args.vocab_size, buckets.capacity[-1]
    rows = max(1, min(spec.batch, engine.scheduler.max_running))
    long = max(2, min(spec.chunk_tokens + 40, spec.prompt_tokens, limit - 8))
    near_edge = max(2, min(buckets.capacity[0] - 2, spec.prompt_tokens))
    short_top = max(2, min(spec.prompt_tokens, spec.chunk_tokens, limit - 8))  # the burst's longest prompt
    hits = min(rows, 3)

    def request(length: int, max_tokens: int, base: int, **sampling) -> Sequence:
        ids = [1 + (base + 7 * i) % (vocab - 1) for i in range(length)]
        params = SamplingParams(max_tokens=max_tokens, **sampling)
        seq = Sequence(ids, params, engine.model.tokenizer.detokenizer(), lambda event: None)
        seq.warmup = True
        return seq

    growth = [b for b in buckets.batch if b <= rows]
    arrivals, joined = [], 0
    for b in growth:  # requests join a decoding batch until it holds each batch bucket in turn
        arrivals.append([request(4 + i % 9, 2 * len(growth) + 4, 400 + i) for i in range(joined, b)])
        joined = b
    scenarios = {
        f"a burst of {rows} short requests, greedy, sampled and seeded (batch moves up and down)": [
            [
                request(min(5 + 3 * i, short_top), 2 + i % 5, i, temperature=0.7 * (i % 2), seed=i if i % 2 else None)
                for i in range(rows)
            ]
        ],
        f"requests joining a decoding batch, up to {rows} (batch moves up with live rows: {growth})": arrivals,
        "arrivals filling the slots of requests that ended (holes in a decoding batch)": [
            [request(3 + i % 11, 2 if i % 3 == 0 else 6, 600 + i) for i in range(rows)],
            [request(6 + i % 7, 4, 700 + i) for i in range(0, rows, 3)],  # as many as ended
        ],
        f"a {long}-token prompt (prefill in chunks of {spec.chunk_tokens})": [[request(long, 3, 100)]],
        "penalties, a logit bias and logprobs (the logits processors; steps read back before the next)": [
            [
                request(
                    6,
                    3,
                    300,
                    temperature=0.5,
                    presence_penalty=0.5,
                    repetition_penalty=1.1,
                    logit_bias=((1, 1.0),),
                    logprobs=2,
                )
            ],
        ],
        f"the same {long}-token prompt again and {hits - 1} shorter cuts of it, at once (prefix-cache hits, when "
        "the cache is on; their last chunks run in one call)": [[request(long - j, 2, 100) for j in range(hits)]],
        f"a {near_edge}-token prompt that grows past its capacity bucket (a capacity move)": [
            [request(near_edge, 4, 200)]
        ],
    }
    if rows >= 2:  # (one at a time, requests never share a prefill)
        scenarios[
            "one prompt sent twice at once (its requests share a prefill row: their logits rows are gathered)"
        ] = [[request(7, 3, 900), request(7, 3, 900)]]
    if runner.speculator is not None:
        words = [1 + (500 + 11 * i) % (vocab - 1) for i in range(4)]
        copy = max(8, min(short_top, 24))
        speculating = [request(1, 6, 0, temperature=0.6 * i, seed=i or None) for i in range(min(rows, 2))]
        for seq in speculating:
            seq.prompt_ids = (words * copy)[:copy]
        scenarios["speculative decoding: repetitive prompts, greedy and seeded (verify steps)"] = [speculating]
    return scenarios


def _run_waves(engine: Engine, waves: list[list[Sequence]]) -> None:
    """Submit each wave (stepping while the waiting queue is full), step twice between waves
    so the earlier ones are admitted, prefilled and decoding, then step until every request
    has ended and no step is in flight."""
    seqs: list[Sequence] = []
    for wave in waves:
        for seq in wave:
            while True:
                try:
                    engine.submit(seq)
                    break
                except QueueFullError:  # a waiting queue shorter than the wave: let it drain
                    engine.step()
        seqs += wave
        if len(waves) > 1:  # admitted, prefilled and decoding before the next wave arrives
            engine.step()
            engine.step()
    while not all(s.finish_reason is not None for s in seqs):
        engine.step()
    while engine.runner.busy:  # a step still in flight for a row that already stopped
        engine.step()


def forget_prefixes(engine: Engine) -> None:
    """Empty the prefix cache of what a rehearsal's dummy prompts left, uncounted."""
    engine.runner.prefix.evict(engine.runner.prefix.nbytes)
    engine.runner.prefix.take_stat(engine.model.name)
