"""Unmodified mlx-lm model classes through the adapter's compiled steps (:mod:`models.adapter`)
against each row run alone with mlx-lm's own caches: tiny random float32 configs of the
architectures whose cache kinds differ (full attention, sliding windows as decode rings,
attention sinks, multi-head latent attention, recurrent states, MoE), on the CPU."""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from tests.support_adapter import check_parity

BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
}

#: model_type -> a tiny config of mlx-lm's class of that type (two layers, 64 wide; sliding
#: windows of 4 positions, so the 11-token row wraps its decode ring).
CONFIGS: dict[str, dict] = {
    "llama": {**BASE, "model_type": "llama", "tie_word_embeddings": False},
    "qwen3": {
        **BASE,
        "model_type": "qwen3",
        "head_dim": 16,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        **BASE,
        "model_type": "gemma3_text",
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 4,
        "sliding_window_pattern": 2,
    },
    "gpt_oss": {
        **BASE,
        "model_type": "gpt_oss",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 16,
        "intermediate_size": 64,
        "sliding_window": 4,
    },
    "deepseek_v3": {
        **BASE,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "first_k_dense_replace": 1,
        "num_key_value_heads": 4,
    },
    "glm4_moe": {
        **BASE,
        "model_type": "glm4_moe",
        "max_position_embeddings": 512,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "n_group": 1,
        "head_dim": 16,
        "topk_group": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "use_qk_norm": True,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "partial_rotary_factor": 0.5,
    },
    "qwen3_next": {
        **BASE,
        "model_type": "qwen3_next",
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 512,
        "head_dim": 16,
        "full_attention_interval": 2,
    },
    "lfm2": {
        "model_type": "lfm2",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "block_ff_dim": 128,
        "full_attn_idxs": [1],
    },
    "mamba": {
        "model_type": "mamba",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 8,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 8,
    },
    "falcon_h1": {
        "model_type": "falcon_h1",
        "hidden_size": 64,
        "head_dim": 16,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 8,
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "mamba_n_heads": 4,
        "mamba_chunk_size": 8,
    },
    "baichuan_m1": {
        "model_type": "baichuan_m1",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 10000.0,
        "sliding_window": 4,
        "sliding_window_layers": [0],
        "conv_window": 2,
        "rms_norm_eps": 1e-5,
    },
    "olmo2": {**BASE, "model_type": "olmo2"},
    "phi3": {**BASE, "model_type": "phi3"},
    "mistral3": {  # Mistral 3 / Ministral 3: the text model inside, with Llama 4's attention scaling
        "model_type": "mistral3",
        "text_config": {
            **BASE,
            "model_type": "ministral3",
            "head_dim": 16,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "rope_theta": 10000.0,
                "llama_4_scaling_beta": 0.1,
                "original_max_position_embeddings": 8,
            },
        },
    },
}


def tiny(config: dict) -> nn.Module:
    """mlx-lm's Model of ``config["model_type"]`` built from ``config``, parameters evaluated."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Baichuan-M1 starts its key and value convolutions at zero (a checkpoint sets them): all
    # keys would be zero and positions would not matter.
    convs = {
        k: mx.random.normal(v.shape)
        for k, v in tree_flatten(model.parameters())
        if isinstance(v, mx.array) and k.endswith(("conv_k", "conv_v"))
    }
    model.update(tree_unflatten(list(convs.items())))
    mx.eval(model.parameters())
    return model


@pytest.fixture(autouse=True)
def _cpu():
    with mx.stream(mx.cpu):
        yield


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_adapter_matches_mlx_lm(model_type):
    report = check_parity(tiny(CONFIGS[model_type]))
    assert report.ok, str(report)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_next", "baichuan_m1"])
def test_shifted_positions_fail_parity(model_type):
    """The control: decode positions off by one must show in the logits, so a pass above
    means something."""
    report = check_parity(tiny(CONFIGS[model_type]), shift=1)
    assert report.error is None, report.error
    assert not report.ok, str(report)
    assert max(report.diffs.values()) > 10 * report.tolerance
