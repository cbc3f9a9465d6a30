"""Speculative decoding's warm-up: compile the verify step (and the draft model's steps) of every
bucket plain decoding warms, and measure, per batch bucket, what a verify step costs against a
plain decode step, so that speculation runs only where it can pay (like ``compile=auto``
measures compiled against eager, service/engine/compile_cache.py).

The calibration runs at the smallest warmed capacity of each batch bucket on dummy inputs:
``plain`` is the seconds per step of 4 pipelined decode steps (queued with ``mx.async_eval``, as
the runner runs them; 3 runs); ``speculative`` is the seconds of one verify step of width K + 1,
with the draft's K decode steps before it when there is a draft, read back (3 runs).
Each figure is the fastest of its runs (the least disturbed by other work on the machine). A
bucket whose ratio ``speculative / plain`` is at least K + 1 (the most tokens a verify step can
yield per row) never speculates, and its verify steps are not compiled; the others keep the
ratio for the runtime decision (:meth:`Speculator.plan`), where it is r: a verify step speculates
only when the rows' expected tokens beat it, and each row's credit is charged by it.

The ratio is measured on greedy steps of device work: a sampled batch's verify step also draws
its keys and accepts (``spec_keys``, ``spec_accept``), each verify step does host work a plain
step hides behind the device (it is read back, and the plain step in flight is read back
before it), and larger capacities cost both steps more. Where those make a verify step dearer
than measured, the decision speculates slightly more than it should; the bound it states holds
against the measured ratio.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import mlx.core as mx

from models.kv_cache import KVCache
from service.engine.draft import DraftProposer
from service.engine.draft import warm as warm_draft
from service.engine.executor import Executor, PagedTables
from service.engine.speculative import Speculator
from service.engine.warmup import Step

log = logging.getLogger("stepserve.engine")
PLAIN_STEPS = 4  # pipelined decode steps timed per batch bucket
REPEATS = 3  # runs timed per batch bucket (the fastest counts)


def warm(
    executor: Executor, spec: Speculator, steps: list[Step], progress: Callable[[int, str], None] | None = None
) -> None:
    """Calibrate and compile speculation for every batch bucket that ``steps`` (the warm-up plan)
    decodes at; fills ``spec.ratios`` and ``spec.calibration``."""
    decode = sorted((b, c) for phase, b, c, _ in steps if phase == "decode")
    draft = spec.proposer if isinstance(spec.proposer, DraftProposer) else None
    if draft is not None:  # the draft recomputes a row's text with the target's chunk buckets
        for phase, b, t, c in steps:
            if phase == "chunk" and b == 1:  # (the draft prefills one row at a time)
                _timed(lambda b=b, t=t, c=c: warm_draft(draft, "chunk", b, t, c), f"draft chunk b{b}x{t}c{c}", progress)
    W, built = spec.tokens + 1, set()
    for B in sorted({b for b, _ in decode}):
        capacities = [c for b, c in decode if b == B]
        if spec.max_batch is not None:
            ratio, on = 1.0, B <= spec.max_batch
            figures = {"configured": f"speculative_max_batch = {spec.max_batch}"}
        else:
            _warm_bucket(executor, spec, B, capacities[0], built, progress)
            C = capacities[0]
            plain, speculative = plain_seconds(executor, B, C), spec_seconds(executor, spec, B, C)
            ratio = speculative / plain
            on = ratio < W
            figures = {"plain_step_s": round(plain, 6), "verify_step_s": round(speculative, 6)}
        spec.calibration[f"b{B}"] = {"ratio": round(ratio, 3), "speculates": on, **figures}
        log.info("speculation at batch %d: %s (ratio %.2f)", B, "on" if on else "off", ratio)
        if not on:
            continue
        spec.ratios[B] = ratio
        for C in capacities:
            _warm_bucket(executor, spec, B, C, built, progress)


def _warm_bucket(
    executor: Executor,
    spec: Speculator,
    B: int,
    C: int,
    built: set[tuple],
    progress: Callable[[int, str], None] | None,
) -> None:
    """Compile (run once) the verify step at (B, K + 1, C), the token selection of batch B and
    the draft's steps at (B, C); ``built`` holds what earlier calls compiled."""
    W, K, V = spec.tokens + 1, spec.tokens, executor.vocab
    ones = mx.ones((B,), mx.float32)
    sampling = (ones, ones, mx.full((B,), V, mx.int32), ones * 0)
    keys = mx.zeros((B, W, 2), mx.uint32)
    calls = [
        ("verify", B, W, C, None),  # over the executor's dummy cache (:meth:`Executor.dummy_inputs`)
        ("spec_keys", B, W, 0, (mx.zeros((B, 2), mx.uint32), mx.zeros((B,), mx.bool_), mx.zeros((W,), mx.int32))),
        (
            "spec_accept",
            B,
            W,
            0,
            (mx.zeros((B, W, V)), mx.zeros((B, K), mx.int32), mx.zeros((B, K, V)), *sampling, keys, keys),
        ),
    ]
    for phase, b, size, capacity, args in calls:
        if (phase, b, size, capacity) in built:
            continue  # built at an earlier capacity
        built.add((phase, b, size, capacity))
        label = f"{phase} b{b}x{size}" + (f"c{capacity}" if capacity else "")
        _timed(lambda p=phase, a=args, s=size, c=capacity: _run(executor, p, B, s, c, a), label, progress)
    if isinstance(spec.proposer, DraftProposer) and ("draft", B, C) not in built:
        draft = spec.proposer
        built.add(("draft", B, C))
        _timed(lambda: warm_draft(draft, "decode", B, C), f"draft decode b{B}x{C}", progress)
        if ("draft_pick", B) not in built:
            built.add(("draft_pick", B))
            _timed(lambda: warm_draft(draft, "draft_pick", B, 0), f"draft pick b{B}", progress)
        if ("draft_greedy",) not in built:  # the draft's own (shapeless) greedy step, keyed by its name
            built.add(("draft_greedy",))
            _timed(lambda: warm_draft(draft, "greedy", 0, 0), "draft greedy", progress)


def _run(executor: Executor, phase: str, B: int, size: int, capacity: int, args: tuple | None) -> None:
    if args is None:  # a model step: its dummy inputs, and the paged pool kept, are the executor's
        executor.warm(phase, B, size, capacity, REPEATS)
        return
    fn = executor.step_fn(phase, B, size, capacity)
    if executor.compiled.policy == "auto":
        fn.calibrate(args, REPEATS)  # type: ignore[attr-defined]  # a compile-cache entry
    else:
        mx.eval(fn(*args))


def _timed(call: Callable[[], None], label: str, progress: Callable[[int, str], None] | None) -> None:
    start = time.perf_counter()
    call()
    log.info("warm-up (speculative): %s ready in %.2f s", label, time.perf_counter() - start)
    del progress  # the warm-up's progress bar counts the plan's steps only


def plain_seconds(executor: Executor, B: int, C: int) -> float:
    """Seconds per plain decode step of batch ``B`` at capacity ``C``, pipelined as the runner
    runs them (greedy tokens; dummy inputs)."""
    greedy, tokens, zeros = executor.step_fn("greedy"), mx.zeros((B,), mx.int32), [0] * B
    kv, decode = executor.dummy_cache(B, C), executor.step_fn("decode", B, C)
    logits, kv = _decode(executor, decode, kv, tokens, zeros)
    mx.eval(greedy(logits), _state(executor, kv))
    runs = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(PLAIN_STEPS):
            logits, kv = _decode(executor, decode, kv, tokens, zeros)
            tokens = greedy(logits)
            mx.async_eval(tokens)
        mx.eval(tokens)
        runs.append((time.perf_counter() - start) / PLAIN_STEPS)
    return min(runs)


def _decode(
    executor: Executor, decode: Callable, kv: KVCache | PagedTables, tokens: mx.array, positions: list[int]
) -> tuple[mx.array, KVCache | PagedTables]:
    """One dummy decode step on this process: over the paged pool through the executor (which
    keeps the pool it writes), else ``decode`` (the compiled step) on the linear cache ``kv``."""
    if isinstance(kv, PagedTables):
        return executor.decode(kv, tokens, positions)
    return decode(executor.model.params, tokens, mx.array(positions, mx.int32), kv)


def _state(executor: Executor, kv: KVCache | PagedTables) -> list[mx.array]:
    """The arrays a dummy step over ``kv`` wrote: the linear cache's keys, or the pool's."""
    if isinstance(kv, PagedTables):
        assert executor.pool is not None
        return list(executor.pool.keys)
    return list(kv.keys)


def spec_seconds(executor: Executor, spec: Speculator, B: int, C: int) -> float:
    """Seconds of one speculative step of batch ``B`` at capacity ``C``: the draft's K decode
    steps (when there is a draft), the verify step and its greedy selection, read back."""
    W = spec.tokens + 1
    verify, greedy = executor.step_fn("verify", B, W, C), executor.step_fn("greedy")
    draft = spec.proposer.executor if isinstance(spec.proposer, DraftProposer) else None
    times, kv = [], executor.dummy_cache(B, C)
    dkv = draft.new_kv(B, C) if draft is not None else None
    mx.eval(_state(executor, kv), dkv.keys if dkv is not None else [])
    for _ in range(REPEATS + 1):
        start = time.perf_counter()
        tokens = mx.zeros((B,), mx.int32)
        if draft is not None and dkv is not None:
            step = draft.step_fn("decode", B, C)
            for _ in range(spec.tokens):
                logits, dkv = step(draft.model.params, tokens, mx.zeros((B,), mx.int32), dkv)
                tokens = greedy(logits)
        proposals = mx.broadcast_to(tokens[:, None], (B, W))
        if isinstance(kv, PagedTables):  # (the executor keeps the pool the step writes)
            logits, kv = executor.verify(kv, proposals, [0] * B)
        else:
            logits, _ = verify(executor.model.params, proposals, mx.zeros((B,), mx.int32), kv)
        greedy(logits.reshape(B * W, -1)).tolist()
        times.append(time.perf_counter() - start)
    return min(times[1:])
