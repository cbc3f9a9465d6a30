"""``stepserve bench prefix-ttft``: each configuration's timed requests find what it can reuse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from models.loader import LoadedModel
from service.bench.prefix_ttft import _parser, main, measure
from tests.support import TINY, WordTokenizer, random_params


def test_each_configuration_reuses_what_it_can_and_reports_its_ttft():
    tokenizer: Any = WordTokenizer(frozenset())
    model = LoadedModel("tiny", Path("-"), TINY, random_params(seed=4), tokenizer, mx.float32, "dequantized", 0.0)
    args = _parser().parse_args(
        ["--prefix-tokens", "40", "--tail-tokens", "5", "--block-tokens", "8", "--pool-tokens", "512", "--repeats", "2",
         "--chunk-tokens", "32", "--configs", "paged", "static", "none", "paged-none"]
    )  # fmt: skip
    result = measure(model, args)
    assert set(result) == {"paged", "static", "none", "paged-none"}
    assert result["paged"]["cached_tokens"] == result["static"]["cached_tokens"] == [40, 40]
    assert result["none"]["cached_tokens"] == result["paged-none"]["cached_tokens"] == [0, 0]
    assert all(r["ttft_s"] > 0 and len(r["samples_s"]) == 2 for r in result.values())


def test_a_prompt_past_the_pool_is_refused_before_the_model_loads(capsys):
    assert main(["--prefix-tokens", "600", "--pool-tokens", "512"]) == 2
    assert "cannot hold 600 + 24 tokens" in capsys.readouterr().out
