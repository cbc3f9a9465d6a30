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

if TYPE_CHECKING:
    from service.engine.runner import ModelRunner

log = logging.getLogger("stepserve.engine")


@dataclass(frozen=True)
class WarmupSpec:
    """What to compile before serving: buckets of requests of up to ``prompt_tokens`` prompt
    tokens, up to ``batch`` at a time, growing to ``batched_positions`` positions when
    batched (a lone request: every capacity bucket)."""

    prompt_tokens: int = 512
    batch: int = 1
    batched_positions: int | None = None


def plan(buckets: BucketTable, spec: WarmupSpec, max_admit: int = 1) -> list[tuple[str, int, int]]:
    """(phase, batch, size) of the buckets to warm up (:meth:`BucketTable.warmup_shapes`),
    plus the sampler of each batch bucket and the shapeless greedy step; [] when
    ``spec.prompt_tokens`` is 0."""
    max_rows = spec.batch
    prefill, decode = buckets.warmup_shapes(
        spec.prompt_tokens, max_rows, min(max_rows, max_admit), spec.batched_positions
    )
    if not prefill:
        return []
    steps = [("prefill", b, t) for b, t in prefill] + [("decode", b, c) for b, c in decode]
    return steps + [("sample", b, 0) for b in sorted({b for b, _ in prefill + decode})] + [("greedy", 0, 0)]


def dummy_inputs(runner: ModelRunner, phase: str, batch: int, size: int) -> tuple:
    """Arguments of ``phase``'s step function at bucket (batch, size): zero tokens and
    positions, lengths of 1, a zeroed KV cache, zero logits and keys, no seeded rows."""
    params, vocab = runner.model.params, runner.vocab
    if phase == "prefill":
        return params, mx.zeros((batch, size), mx.int32), mx.ones((batch,), mx.int32), runner.new_kv(batch, size)
    if phase == "decode":
        return params, mx.zeros((batch,), mx.int32), mx.zeros((batch,), mx.int32), runner.new_kv(batch, size)
    if phase == "greedy":
        return (mx.zeros((1, vocab), mx.float32),)
    ones = mx.ones((batch,), mx.float32)
    logits, keys = mx.zeros((batch, vocab), mx.float32), mx.zeros((batch, 2), mx.uint32)
    return logits, ones, ones, mx.full((batch,), vocab, mx.int32), keys, mx.zeros((batch,), mx.bool_)


def run(
    runner: ModelRunner, steps: list[tuple[str, int, int]], progress: Callable[[int, str], None] | None = None
) -> float:
    """Warm every step of ``steps`` (logging each with its time) and return the seconds taken."""
    start = time.perf_counter()
    for i, (phase, b, size) in enumerate(steps):
        t0 = time.perf_counter()
        compiled = runner.warm(phase, b, size)
        label = f"{phase} b{b}x{size}" if size else (f"{phase} b{b}" if b else phase)
        how = "compiled" if compiled else "eager"
        log.info("warm-up %d/%d: %s ready in %.2f s, runs %s", i + 1, len(steps), label, time.perf_counter() - t0, how)
        if progress:
            progress(len(steps), label)
    return time.perf_counter() - start
