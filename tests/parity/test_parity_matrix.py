"""Issue #27's parity matrix: every mlx-lm architecture with a tiny config through the
adapter's compiled steps (:func:`tests.support_adapter.check_parity`), and the product's
support table (:mod:`models.adapter.support`) held to what the matrix runs.

Per supported module: rows of 5 and 11 tokens right-padded to one prompt bucket (equal lengths
where the recurrent layers ignore padding), prefill and 3 decode steps under ``mx.compile``
with a bucket move after the first, chunked prefill and, where the model allows it, verify on
the static cache and on the paged pool (against mlx-lm prefilling the text at once);
greedy tokens identical to each row run alone with mlx-lm's own caches and logits within 1e-4
in float32. Per refused module: loading it through the adapter raises ``ModelLoadError``
naming it. CPU, float32, one process.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import mlx_lm.models
import pytest
from mlx_lm.utils import MODEL_REMAPPING

from models.adapter import AdapterArgs
from models.adapter.args import loops_prompts_off_metal
from models.adapter.support import REFUSED, SUPPORTED, check_supported, resolve
from models.errors import ModelLoadError
from tests.parity.build import build_tiny
from tests.parity.tiny_configs import CACHE_KIND, HELPERS, NOT_ON_CPU, TINY_CONFIGS
from tests.support_adapter import check_parity

_MODULES = sorted(p.stem for p in Path(mlx_lm.models.__file__).parent.glob("*.py") if p.stem not in HELPERS)


@pytest.fixture(autouse=True)
def _cpu():
    """Float32 on the CPU, as the reference runs."""
    with mx.stream(mx.cpu):
        yield


def _described(kind: str, equal_lengths: bool) -> str:
    """The :data:`SUPPORTED` entry of a module of cache ``kind`` that passed the matrix."""
    return f"parity matrix: {kind}" + (", equal-length prompts" if equal_lengths else "")


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_module_matches_mlx_lm_or_is_refused(name):
    """A supported module passes parity and its table entry says how; a refused one raises
    at load, naming its model_type and the reason."""
    if name in REFUSED:
        with pytest.raises(ModelLoadError, match=f"'{name}'.*{re.escape(REFUSED[name])}"):
            AdapterArgs.from_module(build_tiny(name))
        return
    assert name not in NOT_ON_CPU, f"{name} cannot run on the CPU, so the matrix cannot support it"
    model = build_tiny(name)
    # what `stepserve models` lists, read off the module without a model, is what the built one does
    assert AdapterArgs.from_module(model).loops_prompts is loops_prompts_off_metal(name)
    report = check_parity(model)
    assert report.ok, str(report)
    equal = any("ignore padding" in note for note in report.notes)
    assert SUPPORTED.get(name) == _described(CACHE_KIND[name], equal)


def test_every_module_is_supported_or_refused():
    """Each architecture module of mlx-lm is in exactly one table, and every supported one is
    run by the matrix above (so the table cannot claim what was not tested)."""
    assert set(SUPPORTED).isdisjoint(REFUSED)
    assert sorted(set(SUPPORTED) | set(REFUSED)) == _MODULES
    assert set(SUPPORTED) <= set(TINY_CONFIGS) - set(NOT_ON_CPU)
    assert all(reason.strip() for reason in REFUSED.values())


@pytest.mark.parametrize("name", sorted(set(REFUSED) - set(TINY_CONFIGS)))
def test_refused_without_a_tiny_config(name):
    """Modules that cannot even be built here are refused by name."""
    with pytest.raises(ModelLoadError, match=f"'{name}'.*stepserve models"):
        check_supported(name)


@pytest.mark.parametrize("alias", sorted(MODEL_REMAPPING))
def test_aliases_resolve_to_their_module(alias):
    """mlx-lm's model_type aliases (mistral -> llama, ...) get their module's verdict."""
    target = MODEL_REMAPPING[alias]
    assert resolve(alias) == target
    if target in SUPPORTED:
        check_supported(alias)
    else:
        with pytest.raises(ModelLoadError, match=f"'{alias}'.*{target}"):
            check_supported(alias)


def test_unknown_model_type_is_refused():
    with pytest.raises(ModelLoadError, match="'no_such_arch'.*stepserve models"):
        check_supported("no_such_arch")


def test_dynamic_rope_is_refused():
    """A supported architecture configured with dynamic NTK RoPE is refused at load: its base
    depends on the position on the host."""
    from mlx_lm.models import llama

    config = {**TINY_CONFIGS["llama"], "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    model = llama.Model(llama.ModelArgs.from_dict(config))
    with pytest.raises(ModelLoadError, match="'llama'.*dynamic"):
        AdapterArgs.from_module(model)
