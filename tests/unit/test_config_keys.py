"""Never a silent wrong model: each architecture's config is fed each key that changes the
math, and the model is either implemented, and then matches mlx-lm on a tiny random model
(prefill and decode, float32), or refused at load with a ModelLoadError naming the file,
the key, its value and what is supported."""

from __future__ import annotations

import mlx.core as mx
import pytest

from models.architectures import architecture
from models.errors import ModelLoadError
from models.kv_cache import KVCache
from models.loader import load_model
from tests.support import ON_GPU, mlx_lm_greedy, tiny_config, write_lm_dir

TOL = 3e-2 if ON_GPU else 1e-3
IDS = [5, 17, 33, 2, 90, 11, 60, 7, 12, 40, 3]  # longer than Gemma's test window of 8
STEPS = 4
TYPES = ("llama", "qwen2", "qwen3", "gemma3_text", "qwen3_moe")
LLAMA_FAMILY = ("llama", "qwen2", "qwen3")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3 |= {"original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
SLIDING = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2}

# (model_type, config keys, the keys mlx-lm reads instead: None = the same)
IMPLEMENTED = [
    *[(t, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, None) for t in TYPES],
    *[(t, {"rope_scaling": YARN}, None) for t in TYPES],
    *[(t, {"rope_scaling": LLAMA3}, None) for t in TYPES],
    *[(t, {"rope_scaling": {"type": "default"}, "hidden_act": "silu"}, None) for t in LLAMA_FAMILY],
    ("llama", {"attention_bias": True, "mlp_bias": True}, None),
    ("llama", {"rope_traditional": True}, None),
    ("llama", SLIDING, None),
    ("llama", {"sliding_window": None}, None),  # Mistral v0.2+
    # transformers >= 5 nests the base and the scaling under rope_parameters
    (
        "llama",
        {"rope_parameters": {**LLAMA3, "rope_theta": 5e5}, "rope_theta": 1e4},  # rope_parameters wins
        {"rope_parameters": None, "rope_scaling": LLAMA3, "rope_theta": 5e5},
    ),
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}, {"rope_theta": 5000.0}),
    # mlx-lm's qwen3_moe ignores rope_scaling (transformers applies it): the reference's attention
    # gets the RoPE mlx-lm's qwen3 builds from the same config (tests.support.write_lm_dir)
    # Qwen2.5/Qwen3: a window switched off, or on for no layer
    ("qwen2", {"use_sliding_window": False, "sliding_window": 4, "max_window_layers": 0}, None),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 4}, None),
    ("qwen3_moe", {"use_sliding_window": False, "sliding_window": 4096}, None),
    ("qwen3_moe", {"norm_topk_prob": False}, None),
    ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": []}, None),
    ("qwen3_moe", {"tie_word_embeddings": True}, None),
    ("gemma3_text", {"hidden_activation": "gelu_pytorch_tanh", "use_bidirectional_attention": False}, None),
    ("gemma3_text", {"query_pre_attn_scalar": 24, "rope_local_base_freq": 500.0}, None),
    ("gemma3_text", {"sliding_window_pattern": 4}, None),
    (
        "gemma3_text",
        {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window_pattern": None},
        {"sliding_window_pattern": 2},
    ),
    (
        "gemma3_text",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            "rope_theta": None,
        },
        {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1e6, "rope_local_base_freq": 10000.0},
    ),
]

# (model_type, config keys, the key and the value the refusal must name)
REFUSED = [
    *[(t, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling", '"dynamic"') for t in TYPES],
    *[(t, {"rope_scaling": {**YARN, "attention_factor": 0.5}}, "rope_scaling", "attention_factor") for t in TYPES],
    *[(t, {"partial_rotary_factor": 0.5}, "partial_rotary_factor", "0.5") for t in TYPES],
    *[(t, {"final_logit_softcapping": 30.0}, "final_logit_softcapping", "30.0") for t in TYPES],
    *[(t, {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping", "50.0") for t in TYPES],
    *[(t, {"quantization_config": {"quant_method": "awq"}}, "quantization_config", "awq") for t in TYPES],
    *[(t, {"hidden_act": "gelu"}, "hidden_act", '"gelu"') for t in TYPES],
    *[(t, {"attention_bias": True}, "attention_bias", "true") for t in TYPES if t != "llama"],
    ("llama", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling", "longrope"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling", "low_freq_factor"),
    ("qwen3", {"rope_scaling": {**YARN, "truncate": False}}, "rope_scaling", "truncate"),
    ("qwen3", {"rope_scaling": {**YARN, "mscale": 0.7}}, "rope_scaling", "mscale"),
    ("llama", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "rope_parameters", "0.5"),
    ("llama", {"sliding_window": 4096}, "sliding_window", "4096"),  # Mistral v0.1: every layer
    ("llama", {"layer_types": ["sliding_attention"] * 4, "sliding_window": 8}, "layer_types", "full_attention"),
    ("llama", {"layer_types": ["chunked_attention"] * 4}, "layer_types", "chunked_attention"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, "use_sliding_window", "true"),
    ("qwen3", SLIDING, "layer_types", "sliding_attention"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window", "true"),
    ("gemma3_text", {"hidden_activation": "gelu"}, "hidden_activation", '"gelu"'),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention", "true"),
    ("gemma3_text", {"mlp_bias": True}, "mlp_bias", "true"),
    (
        "gemma3_text",
        {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}},
        "rope_parameters.full_attention",
        "dynamic",
    ),
]


def ours_greedy(directory, steps: int = STEPS) -> tuple[list[int], list[mx.array]]:
    """Greedy tokens and logits from stepserve's steps: a prefill, then decode on a cache of 32
    positions whose sliding layers are rings (as the runner's decode cache)."""
    model = load_model(directory, "tiny", mx.float32, "quantized")
    a, arch = model.args, architecture(model.args.model_type)
    kv = KVCache.allocate(a.num_hidden_layers, 1, a.num_key_value_heads, len(IDS), a.dim_per_head, mx.float32)
    logits, kv = arch.prefill(model.params, mx.array([IDS], mx.int32), mx.array([len(IDS)]), kv, args=a)
    decode_kv = KVCache.allocate(
        a.num_hidden_layers, 1, a.num_key_value_heads, 32, a.dim_per_head, mx.float32, a.windows
    )
    decode_kv.insert_row(0, kv, 0, len(IDS))
    history, tokens = [logits[0]], []
    for i in range(steps):
        tokens.append(int(mx.argmax(logits[0])))
        step = (mx.array([tokens[-1]], mx.int32), mx.array([len(IDS) + i], mx.int32))
        logits, decode_kv = arch.decode(model.params, *step, decode_kv, args=a)
        history.append(logits[0])
    return tokens, history


@pytest.mark.parametrize("model_type,keys,reference_keys", IMPLEMENTED)
def test_implemented_keys_match_mlx_lm(tmp_path, model_type, keys, reference_keys):
    config = {k: v for k, v in tiny_config(model_type, **keys).items() if v is not None}
    reference = {
        k: v for k, v in tiny_config(model_type, **{**keys, **(reference_keys or {})}).items() if v is not None
    }
    model = write_lm_dir(tmp_path / "model", config, reference=reference)
    tokens, logits = ours_greedy(tmp_path / "model")
    expected_tokens, expected = mlx_lm_greedy(model, IDS, STEPS)
    assert tokens == expected_tokens
    assert max(mx.abs(a - b).max().item() for a, b in zip(logits, expected, strict=True)) < TOL


@pytest.mark.parametrize("model_type,keys,key,value", REFUSED)
def test_unimplemented_keys_are_refused_at_load(tmp_path, model_type, keys, key, value):
    config = tiny_config(model_type, **keys)
    write_lm_dir(tmp_path / "model", config, reference=tiny_config(model_type))
    with pytest.raises(ModelLoadError) as refused:
        load_model(tmp_path / "model", "tiny", mx.float32)
    message = str(refused.value)
    assert str(tmp_path / "model" / "config.json") in message
    assert key in message and value in message and "not implemented (supported: " in message


@pytest.mark.parametrize("model_type", ["gpt2", "gemma2", "qwen2_moe"])
def test_an_unknown_model_type_is_refused_naming_the_supported_ones(tmp_path, model_type):
    """As ``model_impl = "native"`` (``auto`` serves such a type through mlx-lm's class, or
    refuses it naming ``stepserve models``: tests/unit/test_lm_loader.py)."""
    write_lm_dir(tmp_path / "model", tiny_config("llama"))
    config = (
        (tmp_path / "model/config.json").read_text().replace('"model_type": "llama"', f'"model_type": "{model_type}"')
    )
    (tmp_path / "model/config.json").write_text(config)
    supported = "gemma3_text, llama, mistral, qwen2, qwen3, qwen3_moe"
    with pytest.raises(ModelLoadError, match=f"model_type '{model_type}' is not supported; supported: {supported}"):
        load_model(tmp_path / "model", "tiny", mx.float32, impl="native")


def test_every_architecture_is_covered():
    assert {t for t, _, _ in IMPLEMENTED} == set(TYPES) == {t for t, _, _, _ in REFUSED}
    assert all(architecture(t) for t in TYPES)
