"""Model directories through mlx-lm's own construction (:mod:`models.lm_loader`): which
implementation ``model_impl`` picks, the loaded module against mlx-lm's own load of the same
directory (float and 4-bit weights, kept or expanded), a GGUF file (native under ``auto``,
mlx-lm's llama under ``mlx_lm``), models whose recurrent layers ignore padding (served, in exact
rows), the refusals at start-up (a refused or unknown ``model_type``, a draft for a model without
a verify step), the per-model setting and ``stepserve models``."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama as mlx_lm_llama
from mlx_lm.utils import load_model as lm_load_model

from models import architectures
from models.adapter import AdapterArgs, prefill
from models.adapter.support import REFUSED, SUPPORTED
from models.default import default_model_path
from models.errors import ModelLoadError
from models.loader import load_model
from models.model_args import ModelArgs
from service.cli import main
from service.config import load_settings
from service.process.startup import load_models
from tests.parity.tiny_configs import TINY_CONFIGS
from tests.support import write_mlx_lm_dir

PROMPT = [5, 17, 3, 99, 42, 7, 1]


def logits_of(model, directory, padded: bool = True) -> tuple[mx.array, mx.array]:
    """(the served model's prefill logits of PROMPT [V] (its row padded by one token where
    ``padded``), mlx-lm's own load of ``directory``'s last logits [V]), both float32."""
    reference, _ = lm_load_model(directory)
    reference.set_dtype(mx.float32)
    expected = reference(mx.array([PROMPT]))[0, -1]
    args = model.args
    row = PROMPT + ([0] if padded else [])
    tokens, lengths = mx.array([row], mx.int32), mx.array([len(PROMPT)], mx.int32)
    got, _ = prefill(model.params, tokens, lengths, args.allocate(1, len(row), mx.float32), args=args)
    return got[0], expected.astype(mx.float32)


@pytest.mark.parametrize("name", ["qwen3_next", "phi3", "gpt_oss"])
def test_auto_serves_a_type_without_a_hand_written_module_through_mlx_lm(tmp_path, name):
    write_mlx_lm_dir(tmp_path / name, TINY_CONFIGS[name])
    model = load_model(tmp_path / name, name, mx.float32, "dequantized")
    assert isinstance(model.args, AdapterArgs) and model.args.model_type == name
    assert model.args.vocab_size == TINY_CONFIGS[name]["vocab_size"]
    got, expected = logits_of(model, tmp_path / name)
    assert mx.allclose(got, expected, atol=1e-4).item(), mx.abs(got - expected).max().item()
    assert model.tokenizer.stop_token_ids == frozenset({0})


def test_model_impl_picks_the_implementation_of_a_hand_written_type(tmp_path):
    write_mlx_lm_dir(tmp_path / "llama", TINY_CONFIGS["llama"])
    assert isinstance(load_model(tmp_path / "llama", "m", mx.float32).args, ModelArgs)
    assert isinstance(load_model(tmp_path / "llama", "m", mx.float32, impl="native").args, ModelArgs)
    model = load_model(tmp_path / "llama", "m", mx.float32, impl="mlx_lm")
    assert isinstance(model.args, AdapterArgs)
    got, expected = logits_of(model, tmp_path / "llama")
    assert mx.allclose(got, expected, atol=1e-4).item()


@pytest.mark.parametrize("weights", ["quantized", "dequantized"])
def test_a_4_bit_directory_loads_as_mlx_lm_loads_it(tmp_path, weights):
    write_mlx_lm_dir(tmp_path / "q", TINY_CONFIGS["phi3"], quantize=(32, 4))
    model = load_model(tmp_path / "q", "m", mx.float32, weights)
    assert isinstance(model.args, AdapterArgs)
    quantized = [m for _, m in model.args.module.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert bool(quantized) == (weights == "quantized")
    got, expected = logits_of(model, tmp_path / "q")
    assert mx.allclose(got, expected, atol=1e-4).item(), mx.abs(got - expected).max().item()


def test_native_refuses_a_type_without_a_hand_written_module(tmp_path):
    write_mlx_lm_dir(tmp_path / "m", TINY_CONFIGS["qwen3_next"])
    with pytest.raises(ModelLoadError, match="model_type 'qwen3_next' is not supported; supported: "):
        load_model(tmp_path / "m", "m", mx.float32, impl="native")


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_a_refused_model_type_is_named_with_its_reason_before_any_weight_is_read(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(ModelLoadError) as error:
        load_model(tmp_path, "m", mx.float32)
    message = str(error.value)
    assert f"model_type '{model_type}'" in message and REFUSED[model_type] in message
    assert "stepserve models" in message and "config.json" in message


def test_a_model_type_mlx_lm_does_not_know_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(ModelLoadError, match="model_type 'no_such_model' is not supported: mlx-lm has no module"):
        load_model(tmp_path, "m", mx.float32)


@pytest.mark.parametrize("name", ["mamba", "nemotron_h"])
def test_recurrent_layers_that_ignore_padding_load_and_are_served_exactly(tmp_path, name):
    """Their layers do not read ``ArraysCache.lengths`` (``pads_prompts`` False): they load,
    and the engine prefills them in exact rows (tests/unit/test_engine_adapter.py)."""
    write_mlx_lm_dir(tmp_path / name, TINY_CONFIGS[name])
    model = load_model(tmp_path / name, name, mx.float32, "dequantized")
    assert isinstance(model.args, AdapterArgs) and not model.args.pads_prompts and model.args.has_states
    got, expected = logits_of(model, tmp_path / name, padded=False)
    assert mx.allclose(got, expected, atol=1e-4).item(), mx.abs(got - expected).max().item()


def test_a_gguf_file_is_native_under_auto_and_mlx_lms_llama_under_mlx_lm():
    assert not architectures.uses_mlx_lm(default_model_path(), "auto")
    assert architectures.uses_mlx_lm(default_model_path(), "mlx_lm")
    model = load_model(default_model_path(), "m", mx.float32, impl="mlx_lm")
    assert isinstance(model.args, AdapterArgs) and isinstance(model.args.module, mlx_lm_llama.Model)
    assert model.args.module.args.rope_traditional  # llama.cpp's permuted Q/K rows, kept


def test_a_missing_gguf_file_as_mlx_lm_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"model file .*absent\.gguf does not exist"):
        load_model(tmp_path / "absent.gguf", "m", mx.float32, impl="mlx_lm")


def test_model_impl_is_a_per_model_setting(tmp_path):
    settings = load_settings(
        model_impl="mlx_lm",
        models=[{"name": "a"}, {"name": "b", "model_impl": "native"}],
    )
    assert [m.model_impl for m in settings.served_models()] == ["mlx_lm", "native"]
    assert load_settings().served_models()[0].model_impl == "auto"


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_a_draft_for_a_model_with_recurrent_state_is_refused_naming_the_setting(tmp_path, kv_cache):
    """A verify step cannot take back a state, so on the static cache the fix named is
    speculative = 'off'; the paged pool holds no recurrent state at all, so there the model is
    refused for kv_cache first, before its draft (the one-process start-up check a group runs too)."""
    write_mlx_lm_dir(tmp_path / "m", TINY_CONFIGS["qwen3_next"])
    settings = load_settings(
        model=tmp_path / "m",
        speculative="draft",
        draft_model=tmp_path / "m",
        warmup_prompt_tokens=0,
        warmup_batch=1,
        kv_cache=kv_cache,
        kv_pool_tokens=96,
    )
    expected = {
        "static": r"'draft' is not implemented for models with recurrent state .* set speculative = 'off'",
        "paged": r"kv_cache = 'paged' cannot hold the caches of model_type 'qwen3_next' \(some layer keeps a "
        r"recurrent state\); set kv_cache = 'static'",
    }[kv_cache]
    with pytest.raises(ModelLoadError, match=expected):
        load_models(settings)


def test_stepserve_models_lists_the_supported_and_refused_types(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    supported, refused = out.split("refused model_types:")
    for model_type, how in SUPPORTED.items():
        assert f"  {model_type}: " in supported and how in supported
    for model_type, reason in REFUSED.items():
        assert f"  {model_type}: {reason}" in refused
    assert "  llama: native (models.llama); mlx-lm: " in supported
    assert "  qwen2: native (models.qwen2); mlx-lm: " in supported
    assert "  smollm: native (models.llama); splits into pipeline stages (--distributed)\n" in supported
    assert "  deepseek_v3: mlx-lm: parity matrix: mla; splits into pipeline stages" in supported
    assert "  gemma3_text: native (models.gemma3_text); mlx-lm: parity matrix: kv+sliding\n" in supported
    eager = "prefill eager except on a Metal GPU (mlx-lm's gated delta loop)"
    assert f"  qwen3_next: mlx-lm: parity matrix: kv+state; {eager}; splits into pipeline stages" in supported
    assert f"  qwen3_5_moe: mlx-lm: parity matrix: kv+state; {eager};" in supported  # qwen3_5's layers
    loops = {line.split(":")[0].strip() for line in supported.splitlines() if eager in line}
    assert loops == {"qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "kimi_k3", "olmo_hybrid", "bailing_moe_v3"}
