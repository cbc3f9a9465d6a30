"""``stepserve bench hit-profile``: what it times is a prefix-cache hit joining a busy batch."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from models.loader import LoadedModel
from service.bench.hit_profile import PARTS, HitBench, main
from service.engine.buckets import BucketTable
from tests.support import TINY, WordTokenizer, random_params


def test_each_measured_prompt_hits_the_cached_system_prompt_and_leaves_the_batch_as_it_was():
    model = LoadedModel(
        "tiny", Path("-"), TINY, random_params(seed=2), WordTokenizer(frozenset()), mx.float32, "dequantized", 0.0
    )
    bench = HitBench(
        model, BucketTable((1, 4, 8), (16, 64), (256,)), prefix_tokens=96, tail_tokens=9, live=3, block_tokens=8
    )
    prefix = bench.engine.prefix
    live = bench.engine.batch.live
    assert len(live) == 3
    hit_before = prefix.hit_tokens
    parts = bench.parts_s()
    assert set(parts) == set(PARTS) and all(d >= 0 and e >= 0 for d, e in parts.values())
    assert prefix.hit_tokens - hit_before == 96  # the system prompt's 12 blocks, none of the 9-token tail
    hit_before = prefix.hit_tokens
    assert bench.iteration_s(4) > 0
    assert prefix.hit_tokens - hit_before == 4 * 96
    assert bench.engine.batch.live == live  # the hits' slots were freed


def test_arguments_that_cannot_fit_are_refused_before_the_model_loads(capsys):
    assert main(["--live", "3", "--batch-buckets", "1", "8", "--capacity", "256", "--prefix-tokens", "96"]) == 2
    assert "do not fit the largest batch bucket (8)" in capsys.readouterr().out  # 3 live + 8 hits (--rows 1 8)
    assert main(["--capacity", "512", "--prefix-tokens", "600"]) == 2
    assert "cannot hold 600 + 41 tokens" in capsys.readouterr().out
