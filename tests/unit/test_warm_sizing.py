"""Warm-up sized to the host (service/process/warm_sizing.py): the FLOP estimate of the planned
steps, the extent chosen for a measured matmul rate, and the user's settings winning over it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import mlx.core as mx
import pytest

from models.blas import cpu_blas
from models.loader import LoadedModel
from models.model_args import ModelArgs
from service.config import load_settings
from service.engine.buckets import BucketTable
from service.engine.warmup import WarmupSpec, plan
from service.process.startup import buckets_of, warmup_extent
from service.process.warm_sizing import (
    layer_params,
    measure_gflops,
    rehearsal_flops,
    size_extent,
    step_flops,
    warmup_flops,
)
from tests.support import TINY, random_params

# The default model's shape (SmolLM2-135M) and the default buckets: what the sizing is for.
SMOLLM2 = ModelArgs(
    hidden_size=576,
    num_hidden_layers=30,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
)
BUCKETS = BucketTable((1, 2, 4, 8, 16, 32, 64), (32, 64, 128, 256, 512), (256, 512, 768, 1024, 2048, 4096, 8192))
CEILING = WarmupSpec(512, 4, 512 + 256, 512, 2048, rehearse=True)
BUDGET = 60.0


def seconds(spec: WarmupSpec, gflops: float) -> float:
    return warmup_flops(SMOLLM2, BUCKETS, spec) / (gflops * 1e9)


def at(prompt_tokens: int, batch: int, rehearse: bool) -> WarmupSpec:
    return dataclasses.replace(
        CEILING, prompt_tokens=prompt_tokens, batch=batch, batched_positions=prompt_tokens + 256, rehearse=rehearse
    )


def test_layer_params_counts_the_matmul_weights_of_the_decoder_layers():
    params = random_params(TINY)
    weights = [
        leaf["weight"]
        for layer in params["layers"]
        for block in (layer["self_attn"], layer["mlp"])
        for leaf in block.values()
    ]
    assert layer_params(TINY) == sum(w.size for w in weights)


def test_step_flops_grow_with_the_batch_and_the_attended_positions():
    for phase, size, capacity in (("prefill", 128, 0), ("chunk", 64, 512), ("decode", 1024, 0)):
        one = step_flops(SMOLLM2, (phase, 1, size, capacity))
        assert step_flops(SMOLLM2, (phase, 4, size, capacity)) == pytest.approx(4 * one)
    # a chunk attending over exactly its own tokens costs what a whole prefill of them does
    assert step_flops(SMOLLM2, ("chunk", 2, 256, 256)) == pytest.approx(step_flops(SMOLLM2, ("prefill", 2, 256, 0)))
    # a decode row is one token of a chunk at the same capacity
    assert step_flops(SMOLLM2, ("decode", 2, 768, 0)) == pytest.approx(step_flops(SMOLLM2, ("chunk", 2, 1, 768)))
    assert step_flops(SMOLLM2, ("decode", 1, 8192, 0)) > step_flops(SMOLLM2, ("decode", 1, 256, 0))
    assert step_flops(SMOLLM2, ("sample", 4, 0, 0)) == 0


def test_the_estimate_counts_every_planned_step_and_the_rehearsals():
    steps = plan(BUCKETS, CEILING)
    total = sum(step_flops(SMOLLM2, s) for s in steps) + rehearsal_flops(SMOLLM2, BUCKETS, CEILING)
    assert warmup_flops(SMOLLM2, BUCKETS, CEILING) == pytest.approx(total)
    assert rehearsal_flops(SMOLLM2, BUCKETS, at(512, 4, False)) == 0
    assert warmup_flops(SMOLLM2, BUCKETS, at(0, 4, True)) == 0  # warms nothing
    # speculation adds its verify steps
    assert warmup_flops(SMOLLM2, BUCKETS, CEILING, verify_tokens=5) > warmup_flops(SMOLLM2, BUCKETS, CEILING)


def test_measure_gflops_is_a_finite_positive_rate():
    rate = measure_gflops(SMOLLM2.hidden_size, SMOLLM2.intermediate_size, mx.float32)
    assert math.isfinite(rate) and rate > 0


def test_a_fast_host_warms_the_whole_ceiling_with_its_rehearsals():
    gflops = warmup_flops(SMOLLM2, BUCKETS, CEILING) / 1e9 / BUDGET  # the ceiling fits exactly
    for rate in (gflops, 10 * gflops):
        coverage = size_extent(SMOLLM2, BUCKETS, CEILING, rate, BUDGET)
        assert (coverage.prompt_tokens, coverage.batch, coverage.rehearse, coverage.reduced) == (512, 4, True, False)
        assert coverage.estimate_s is not None and coverage.estimate_s <= BUDGET and coverage.gflops == rate


def test_the_rehearsals_go_first_when_the_ceiling_does_not_fit():
    gflops = warmup_flops(SMOLLM2, BUCKETS, CEILING) / 1e9 / BUDGET * 0.99
    assert seconds(at(512, 4, False), gflops) <= BUDGET  # (without them it fits)
    coverage = size_extent(SMOLLM2, BUCKETS, CEILING, gflops, BUDGET)
    assert (coverage.prompt_tokens, coverage.batch, coverage.rehearse, coverage.reduced) == (512, 4, False, True)
    assert "would need" in coverage.reason


def candidates() -> list[tuple[int, int, bool]]:
    """The extents in the order of preference: the ceiling with its rehearsals, then without
    them the longest prompts first, then the most concurrent requests."""
    return [(512, 4, True)] + [(p, b, False) for p in (512, 256, 128, 64, 32) for b in (4, 2, 1)]


@pytest.mark.parametrize("gflops", [1.0, 2.5, 4.0, 6.0, 12.0, 25.0, 50.0, 80.0])
def test_a_slow_host_gets_the_most_preferred_extent_that_fits_the_budget(gflops):
    coverage = size_extent(SMOLLM2, BUCKETS, CEILING, gflops, BUDGET)
    fitting = [c for c in candidates() if seconds(at(*c), gflops) <= BUDGET]
    if not fitting:  # nothing fits: nothing is warmed, so nothing runs before ready
        assert coverage.prompt_tokens == 0 and coverage.reduced and "eagerly" in coverage.reason
        assert plan(BUCKETS, at(coverage.prompt_tokens, coverage.batch, coverage.rehearse)) == []
        return
    assert (coverage.prompt_tokens, coverage.batch, coverage.rehearse) == fitting[0]
    assert coverage.reduced == (fitting[0] != candidates()[0])
    assert coverage.estimate_s == pytest.approx(seconds(at(*fitting[0]), gflops))


def test_a_faster_host_never_warms_less():
    rates = [0.5 * 1.5**i for i in range(20)]
    extents = [size_extent(SMOLLM2, BUCKETS, CEILING, r, BUDGET) for r in rates]
    ranks = [candidates().index((c.prompt_tokens, c.batch, c.rehearse)) if c.prompt_tokens else 99 for c in extents]
    assert ranks == sorted(ranks, reverse=True)
    assert ranks[0] == 99 and ranks[-1] == 0  # from nothing to the whole ceiling


def test_a_larger_budget_never_warms_less():
    budgets = [10, 30, 60, 120, 600, 3600]
    extents = [size_extent(SMOLLM2, BUCKETS, CEILING, 4.0, b) for b in budgets]
    assert [c.prompt_tokens for c in extents] == sorted(c.prompt_tokens for c in extents)


def test_the_users_settings_win_over_the_budget():
    slow = 1.0  # GFLOP/s: nothing fits by itself
    assert size_extent(SMOLLM2, BUCKETS, CEILING, slow, BUDGET).prompt_tokens == 0
    fixed_prompt = size_extent(SMOLLM2, BUCKETS, CEILING, slow, BUDGET, prompt_tokens=256)
    assert fixed_prompt.prompt_tokens == 256 and fixed_prompt.batch == 1 and not fixed_prompt.rehearse
    assert "warmup_prompt_tokens is set" in fixed_prompt.reason
    fixed_batch = size_extent(SMOLLM2, BUCKETS, CEILING, 6.0, BUDGET, batch=4)
    assert fixed_batch.batch == 4 and seconds(at(fixed_batch.prompt_tokens, 4, False), 6.0) <= BUDGET
    rehearsing = size_extent(SMOLLM2, BUCKETS, CEILING, 6.0, BUDGET, rehearse=True)
    assert rehearsing.rehearse and rehearsing.prompt_tokens > 0
    # both set and fitting: exactly that, not reduced
    both = size_extent(SMOLLM2, BUCKETS, CEILING, 1e6, BUDGET, prompt_tokens=64, batch=2)
    assert (both.prompt_tokens, both.batch, both.reduced) == (64, 2, False)


def tiny_model() -> LoadedModel:
    return LoadedModel("tiny", Path("-"), TINY, random_params(TINY), None, mx.float32, "dequantized", 0.0)


def test_warmup_extent_on_the_cpu_measures_the_host_unless_both_settings_are_set():
    model = tiny_model()
    settings = load_settings(capacity_buckets=[256, 512])
    coverage = warmup_extent(settings.served_models()[0], model, settings, max_running=8)
    # the tiny model costs next to nothing: the whole CPU ceiling, measured, with the BLAS named
    assert (coverage.prompt_tokens, coverage.batch, coverage.rehearse, coverage.reduced) == (512, 4, True, False)
    assert coverage.gflops is not None and coverage.gflops > 0 and coverage.blas == cpu_blas()

    settings = load_settings(warmup_prompt_tokens=64, warmup_batch=2, warmup_budget_s=0)
    coverage = warmup_extent(settings.served_models()[0], model, settings, max_running=8)
    assert (coverage.prompt_tokens, coverage.batch, coverage.reduced, coverage.gflops) == (64, 2, False, None)


def test_a_zero_budget_warms_nothing_and_says_so(caplog):
    model = tiny_model()
    settings = load_settings(warmup_budget_s=0)
    spec = settings.served_models()[0]
    with caplog.at_level("WARNING", logger="stepserve"):
        coverage = warmup_extent(spec, model, settings, max_running=8)
    assert coverage.prompt_tokens == 0 and coverage.reduced
    assert plan(buckets_of(spec, model), WarmupSpec(coverage.prompt_tokens, coverage.batch)) == []
    assert any("warm-up reduced for this host to nothing" in r.getMessage() for r in caplog.records)
