"""Never a silent wrong model: required shape keys, tensors a config promises, GGUF metadata
keys that change the math, and quantized checkpoints' group sizes (the config.json key
matrix of every architecture is tests/unit/test_config_keys.py)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from models.config_check import unimplemented_config
from models.errors import ModelLoadError
from models.gguf.reader import args_from_metadata, params_from_tensors, read_gguf
from models.kv_cache import KVCache
from models.layers import AFFINE_BITS, quantized_bits
from models.llama import decode, prefill
from models.loader import load_model
from tests.support import ATOL, CONFIG, TINY, random_params, write_dir

IDS = [5, 17, 33, 2, 90, 11, 60, 7]


def logits_ours(directory: Path, steps: int = 4) -> list[mx.array]:
    model = load_model(directory, "tiny", mx.float32)
    a = model.args
    kv = KVCache.allocate(a.num_hidden_layers, 1, a.num_key_value_heads, 32, a.dim_per_head, mx.float32)
    logits, kv = prefill(model.params, mx.array([IDS], mx.int32), mx.array([len(IDS)]), kv, args=a)
    history = [logits[0]]
    for i in range(steps):
        token = mx.argmax(logits, axis=-1).astype(mx.int32)
        logits, kv = decode(model.params, token, mx.array([len(IDS) + i]), kv, args=a)
        history.append(logits[0])
    return history


def logits_mlx_lm(model, steps: int = 4) -> list[mx.array]:
    cache = make_prompt_cache(model)
    history = [model(mx.array([IDS]), cache=cache)[0, -1]]
    for _ in range(steps):
        history.append(model(mx.argmax(history[-1])[None, None], cache=cache)[0, -1])
    return history


def assert_matches_mlx_lm(directory: Path, reference) -> None:
    ours, theirs = logits_ours(directory), logits_mlx_lm(reference)
    worst = max(mx.abs(x - y).max().item() for x, y in zip(ours, theirs, strict=True))
    assert worst < max(ATOL, 1e-4) * 10


# The architecture x key matrix (implemented and matched, or refused) is tests/unit/test_config_keys.py.


def test_a_missing_shape_key_is_refused_not_defaulted(tmp_path):
    write_dir(tmp_path / "model")
    config = json.loads((tmp_path / "model/config.json").read_text())
    del config["hidden_size"]
    (tmp_path / "model/config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'hidden_size' is missing"):
        load_model(tmp_path / "model", "tiny", mx.float32)


@pytest.mark.parametrize(
    "extra,missing",
    [({"attention_bias": True}, "layers.0.self_attn.q_proj.bias"), ({"tie_word_embeddings": False}, "lm_head.weight")],
)
def test_tensors_the_config_promises_must_be_in_the_checkpoint(tmp_path, extra, missing):
    write_dir(tmp_path / "model", **extra)  # weights without biases, with tied embeddings
    with pytest.raises(ModelLoadError, match=f"lacks: .*{missing}"):
        load_model(tmp_path / "model", "tiny", mx.float32)


@pytest.mark.parametrize(
    "config",
    [
        {"rope_theta": 1e6, "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28},  # Qwen2.5
        {"sliding_window": None, "use_sliding_window": False, "max_window_layers": 36, "head_dim": 128},  # Qwen3
        {"rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False},  # Llama 2, SmolLM2
    ],
)
def test_real_configs_without_unimplemented_keys_pass(config):
    assert unimplemented_config({**CONFIG, "num_hidden_layers": 28, **config}) == []


# -- GGUF metadata -------------------------------------------------------------------------------------


def write_gguf(path: Path, metadata: dict | None = None, tensors: dict | None = None) -> Path:
    """The tiny random model as a llama GGUF (weights and hyper-parameters; no tokenizer)."""
    params, a = random_params(), TINY
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    names.update({n: f"attn_{n[0]}" for n in ("q_proj", "k_proj", "v_proj")} | {"o_proj": "attn_output"})
    names.update({f"{n}_proj": f"ffn_{n}" for n in ("gate", "up", "down")})
    arrays = {"token_embd.weight": params["embed_tokens"]["weight"], "output_norm.weight": params["norm"]["weight"]}
    for i, layer in enumerate(params["layers"]):
        for path_, w in tree_flatten(layer):
            arrays[f"blk.{i}.{names[path_.split('.')[-2]]}.weight"] = w

    def u32(value: int) -> mx.array:
        return mx.array(value, mx.uint32)

    meta = {
        "general.architecture": "llama",
        "llama.block_count": u32(a.num_hidden_layers),
        "llama.embedding_length": u32(a.hidden_size),
        "llama.feed_forward_length": u32(a.intermediate_size),
        "llama.attention.head_count": u32(a.num_attention_heads),
        "llama.attention.head_count_kv": u32(a.num_key_value_heads),
        "llama.rope.dimension_count": u32(a.dim_per_head),
    }
    mx.save_gguf(str(path), {**arrays, **(tensors or {})}, {**meta, **(metadata or {})})
    return path


def test_tiny_gguf_without_unimplemented_keys_loads(tmp_path):
    tensors, metadata = read_gguf(write_gguf(tmp_path / "tiny.gguf"))
    args = args_from_metadata(metadata, tensors, tmp_path / "tiny.gguf")
    assert len(params_from_tensors(tensors, args, tmp_path / "tiny.gguf")["layers"]) == TINY.num_hidden_layers


@pytest.mark.parametrize(
    "metadata,tensors,named",
    [
        ({"llama.rope.scaling.type": "yarn"}, {}, 'llama.rope.scaling.type="yarn"'),
        ({"llama.rope.scaling.factor": mx.array(4.0)}, {}, "llama.rope.scaling.factor=4.0"),  # linear by default
        ({"llama.rope.scale_linear": mx.array(2.0)}, {}, "llama.rope.scale_linear=2.0"),
        ({"llama.attention.sliding_window": mx.array(4096, mx.uint32)}, {}, "llama.attention.sliding_window=4096"),
        ({"llama.expert_count": mx.array(8, mx.uint32)}, {}, "llama.expert_count=8"),
        ({"llama.final_logit_softcapping": mx.array(30.0)}, {}, "llama.final_logit_softcapping=30.0"),
        ({"llama.rope.dimension_count": mx.array(8, mx.uint32)}, {}, "llama.rope.dimension_count=8"),
        ({}, {"rope_freqs.weight": mx.ones((8,))}, "tensor rope_freqs.weight"),  # Llama 3.1 RoPE
        ({}, {"blk.0.ffn_gate_exps.weight": mx.ones((2, 4, 4))}, "blk.0.ffn_gate_exps.weight"),
    ],
)
def test_unimplemented_gguf_keys_are_refused_at_load(tmp_path, metadata, tensors, named):
    path = write_gguf(tmp_path / "tiny.gguf", metadata, tensors)
    with pytest.raises(ModelLoadError, match=str(path)) as refused:
        load_model(path, "tiny", mx.float32)
    assert named in str(refused.value)


def test_gguf_rope_scaling_type_none_turns_a_factor_off(tmp_path):
    path = write_gguf(
        tmp_path / "tiny.gguf", {"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": mx.array(4.0)}
    )
    tensors, metadata = read_gguf(path)
    assert args_from_metadata(metadata, tensors, path).head_dim == TINY.dim_per_head


# -- the one quantized-bits helper --------------------------------------------------------------------


@pytest.mark.parametrize("bits", AFFINE_BITS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantized_bits_reads_mx_quantize_shapes(bits, group_size):
    w, scales, biases = mx.quantize(mx.random.normal((8, 256)), group_size=group_size, bits=bits)
    assert quantized_bits({"weight": w, "scales": scales, "biases": biases}, group_size) == bits


def test_quantized_bits_refuses_a_wrong_group_size():
    w, scales, biases = mx.quantize(mx.random.normal((8, 256)), group_size=64, bits=3)
    with pytest.raises(ValueError, match="fits no MLX bit width"):
        quantized_bits({"weight": w, "scales": scales, "biases": biases}, 128)


def test_a_group_size_that_does_not_match_the_weights_is_refused(tmp_path):
    # 4-bit weights at group size 64 have the shapes of 8-bit weights at group size 32.
    write_dir(tmp_path / "model", quantize=(64, 4), quantization={"group_size": 32, "bits": 4})
    with pytest.raises(ModelLoadError, match="holds 8-bit weights at group size 32, but the config says 4 bits"):
        load_model(tmp_path / "model", "tiny", mx.float32)


def test_quantized_directory_matches_mlx_lm(tmp_path):
    reference = write_dir(tmp_path / "model", quantize=(64, 4), quantization={"group_size": 64, "bits": 4})
    assert_matches_mlx_lm(tmp_path / "model", reference)
