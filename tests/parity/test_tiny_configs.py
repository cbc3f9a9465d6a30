"""Smoke test of the tiny mlx-lm configs: every architecture builds and decodes consistently.

For each config, eagerly and with mlx-lm's own prompt cache: a 5-token prefill and 3 one-token
decode steps must give finite logits equal (within 1e-4) to the matching positions of one
8-token forward. This is mlx-lm's own incremental == full consistency, the reference the
parity matrix compares stepserve's compiled steps against.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx_lm.models
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.parity.build import build_tiny, cache_kind
from tests.parity.tiny_configs import (
    CACHE_KIND,
    HELPERS,
    NOT_ON_CPU,
    QUIRKS,
    SKIPPED,
    TINY_CONFIGS,
)

PROMPT_LEN = 5
DECODE_STEPS = 3
ATOL = 1e-4  # float32 logits of a random model of width <= 64

_MODELS_DIR = Path(mlx_lm.models.__file__).parent
_HAS_METAL = mx.metal.is_available()


def _params(names, quirks_fail: bool) -> list:
    """pytest params for `names`: those that cannot run here skipped and, if `quirks_fail`,
    QUIRKS marked as strict expected failures."""
    params = []
    for name in names:
        marks = []
        if name in NOT_ON_CPU and not _HAS_METAL:
            marks.append(pytest.mark.skip(reason=NOT_ON_CPU[name]))
        if quirks_fail and name in QUIRKS:
            marks.append(pytest.mark.xfail(reason=QUIRKS[name], strict=True))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.fixture(autouse=True)
def _cpu():
    """Run on the CPU in float32, as the parity matrix's reference does."""
    with mx.stream(mx.cpu):
        yield


def _max_decode_error(name: str) -> float:
    """Largest |incremental - full| logit over the prefill and each decode step of `name`.

    Raises AssertionError if any logit is not finite.
    """
    model = build_tiny(name)
    tokens = mx.random.randint(0, 128, (1, PROMPT_LEN + DECODE_STEPS), key=mx.random.key(1))
    full = model(tokens, cache=make_prompt_cache(model))  # [1, 8, vocab]
    cache = make_prompt_cache(model)
    errors = [mx.abs(model(tokens[:, :PROMPT_LEN], cache=cache) - full[:, :PROMPT_LEN]).max()]
    for i in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
        step = model(tokens[:, i : i + 1], cache=cache)  # [1, 1, vocab]
        assert mx.isfinite(step).all().item(), f"{name}: decode step {i} not finite"
        errors.append(mx.abs(step[:, -1] - full[:, i]).max())
    assert mx.isfinite(full).all().item(), f"{name}: full forward not finite"
    return cast(float, mx.stack(errors).max().item())  # mlx types item() as any scalar


@pytest.mark.parametrize("name", _params(sorted(TINY_CONFIGS), quirks_fail=True))
def test_incremental_decode_matches_full_forward(name):
    assert _max_decode_error(name) <= ATOL


@pytest.mark.parametrize("name", _params(sorted(TINY_CONFIGS), quirks_fail=False))
def test_cache_kind_is_as_recorded(name):
    assert cache_kind(build_tiny(name)) == CACHE_KIND[name]


def test_every_module_is_classified():
    """A module mlx-lm adds (or renames) must be given a tiny config, a skip reason or a helper."""
    modules = {p.stem for p in _MODELS_DIR.glob("*.py")}
    classified = set(TINY_CONFIGS) | set(SKIPPED) | HELPERS
    assert sorted(modules - classified) == []
    assert sorted(classified - modules) == []
    assert set(TINY_CONFIGS).isdisjoint(SKIPPED)
    assert set(CACHE_KIND) == set(TINY_CONFIGS)
    assert set(QUIRKS) <= set(TINY_CONFIGS) and set(NOT_ON_CPU) <= set(TINY_CONFIGS)


def test_helpers_have_no_model_class():
    """The helper list holds no architecture: none of its modules defines `Model`."""
    for name in sorted(HELPERS - {"__init__"}):
        module = importlib.import_module(f"mlx_lm.models.{name}")
        assert not hasattr(module, "Model"), name


def test_every_config_names_its_module():
    """Each config's model_type is the module name, or the module wraps a text_config."""
    for name, cfg in TINY_CONFIGS.items():
        assert cfg.get("model_type") == name, name
