"""The warm-up driver, above the engine: on the engine thread, before it serves, compile every
bucket of the warm-up plan (:mod:`service.engine.warmup`) on the executor's dummy inputs,
calibrate and compile speculation (:mod:`service.engine.spec_warmup`), then rehearse: dummy
requests through the engine's own :meth:`Engine.step`, and the app's HTTP rehearsal
(:mod:`service.api.rehearsal`) when there is one. :func:`warm_up` is what the engine thread is
given to run at start (:meth:`Engine.start`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from models.tokenizer import ChatTokenizer
from service.engine import spec_warmup, warmup
from service.engine.core import IDLE_WAIT_S, Engine
from service.engine.executor import Executor
from service.engine.grammar import GrammarError
from service.engine.scheduler import QueueFullError
from service.engine.sequence import SamplingParams, Sequence
from service.engine.warmup import Step, WarmupSpec

log = logging.getLogger("stepserve.engine")


def warm_up(
    engine: Engine,
    spec: WarmupSpec,
    progress: Callable[[int, str], None] | None = None,
    http_rehearsal: Callable[[], Future[list[str]]] | None = None,
) -> None:
    """Warm ``engine`` up as ``spec`` says, on its thread before it serves: the plan's buckets,
    speculation's verify steps and calibration, the rehearsal (``spec.rehearse``), the grammar
    compiler, and ``http_rehearsal`` (it starts the app's own rehearsal requests on the app's
    event loop; the engine steps until they are answered). Sets the engine's
    ``warmup_seconds``, ``warmup_buckets`` and ``rehearsed`` and the compiled-step metrics.
    ``progress(total, label)`` is called after each bucket of the plan."""
    start = time.perf_counter()
    args = engine.model.args
    spec = dataclasses.replace(
        spec, batched_chunks=engine.executor.batches_chunks, recurrent=args.has_states, padded_prompts=args.pads_prompts
    )
    engine.prefiller.rows_cap = warmup.warmed_batch(engine.buckets, spec)
    steps = warmup.plan(engine.buckets, spec)
    run(engine.executor, steps, progress)
    if engine.speculator is not None:  # its verify (and draft) steps, and its calibration
        spec_warmup.warm(engine.executor, engine.speculator, steps, progress)
    if spec.rehearse and steps:
        engine.rehearsed = rehearse(engine, spec)
    if isinstance(engine.model.tokenizer, ChatTokenizer):  # (tests' toy tokenizers have none)
        try:
            engine.grammars  # noqa: B018  # built now, not under the first structured request
        except GrammarError as exc:  # the model serves free text; structured requests get 400
            log.warning("model %s: %s", engine.model.name, exc)
    if spec.rehearse and steps and http_rehearsal is not None:
        engine.rehearsed += _serve_rehearsal(engine, http_rehearsal())
    engine.warmup_seconds, engine.warmup_buckets = time.perf_counter() - start, len(steps)
    for key, compiled in engine.executor.compiled.choices().items():
        engine.metrics.compiled_step.labels(key.model, key.phase, key.bucket).set(int(compiled))
    log.info("warm-up done: %d buckets in %.1f s", len(steps), engine.warmup_seconds)


def _serve_rehearsal(engine: Engine, requests: Future[list[str]]) -> list[str]:
    """Step ``engine`` until the app's rehearsal requests are answered; returns what they were."""
    while not requests.done() and not engine.stopping:
        if not engine.step():
            engine.scheduler.wait_for_work(IDLE_WAIT_S)
    forget_prefixes(engine)
    if not requests.done():
        return []
    if (exc := requests.exception()) is not None:  # a bug to fix, but no reason not to serve
        log.warning("HTTP rehearsal failed: %s: %s", type(exc).__name__, exc)
        return [f"HTTP rehearsal failed: {type(exc).__name__}"]
    for line in requests.result():
        log.info("warm-up rehearsal: %s", line)
    return requests.result()


def run(executor: Executor, steps: list[Step], progress: Callable[[int, str], None] | None = None) -> float:
    """Warm every step of ``steps`` (:meth:`Executor.warm`, logging each with its time) and return
    the seconds taken."""
    start = time.perf_counter()
    for i, (phase, b, size, capacity) in enumerate(steps):
        t0 = time.perf_counter()
        compiled = executor.warm(phase, b, size, capacity)
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
    speculator = engine.speculator
    scenarios = rehearsal_scenarios(engine, spec)
    if speculator is not None:  # verify steps (forced on: what they build is built whatever warm-up measured)
        speculator.forced = True
    done = []
    for name, waves in scenarios.items():
        _run_waves(engine, waves)
        done.append(name)
        log.info("warm-up rehearsal: %s", name)
    forget_prefixes(engine)
    if speculator is not None:
        speculator.forced = False
    return done


def rehearsal_scenarios(engine: Engine, spec: WarmupSpec) -> dict[str, list[list[Sequence]]]:
    """The rehearsal's scenarios, by what each exercises: each a list of waves of dummy
    requests (``warmup`` set; token ids spread over the vocabulary), a wave submitted once the
    one before it is decoding. Sized by ``spec`` (batch, prompt and chunk tokens) within the
    engine's buckets and running limit."""
    buckets = engine.buckets
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
    if engine.speculator is not None:
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
    """Empty the prefix cache (a paged pool's cached blocks too) of what a rehearsal's dummy
    prompts left, uncounted (:meth:`Engine.forget_prefixes`)."""
    engine.forget_prefixes()
