"""Tiny random configs for every mlx-lm text architecture module (issue #27's parity matrix).

`TINY_CONFIGS[name]` is a config dict such that
`mlx_lm.models.<name>.Model(mlx_lm.models.<name>.ModelArgs.from_dict(cfg))` builds a model of a
few thousand to a few hundred thousand parameters: hidden width 32-64, 2-4 layers, vocab 256, at
most 4 experts. The layer counts and per-layer patterns are chosen so that every layer kind of the
architecture appears at least once (a sliding and a full attention layer, a recurrent/linear and an
attention layer, a dense and an MoE layer, ...). Many configs start from `_BASE`: mlx-lm's
`BaseModelArgs.from_dict` keeps only the keys its dataclass declares, so keys a module does not use
are ignored (the convention mlx-lm's own configs rely on).

`SKIPPED[name]` says why a module in `mlx_lm/models` has no tiny config, and `HELPERS` lists the
modules that are not architectures at all. `QUIRKS[name]` records architectures that build but whose
eager incremental decode (mlx-lm's own cache) differs from a full-sequence forward, or that need
special handling by a cache adapter. `CACHE_KIND[name]` classifies each architecture's cache (see
its comment). `HOST_SYNCS[name]` lists host synchronisations found in the module's forward path.

Versions: mlx-lm 0.32.2 (the module list and field names are read from that release).
"""

from __future__ import annotations

from typing import Any

# Keys shared by most Llama-like configs; modules ignore the keys they do not declare.
_BASE: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    norm_eps=1e-5,
    layer_norm_eps=1e-5,
    layer_norm_epsilon=1e-5,
    vocab_size=256,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
)

# Mixture-of-experts fields under their common names: 4 routed experts, top-2, one shared expert,
# the first layer dense (so a 2-layer model has one dense and one MoE layer).
_MOE: dict[str, Any] = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    num_shared_experts=1,
    shared_expert_intermediate_size=32,
    first_k_dense_replace=1,
    decoder_sparse_step=1,
    mlp_only_layers=[0],
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
)

# Multi-head latent attention (DeepSeek-V2 style) widths.
_MLA: dict[str, Any] = dict(
    kv_lora_rank=32,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)

# YaRN rope scaling with factor 1 (DeepSeek-V2 reads these keys unconditionally).
_YARN: dict[str, Any] = dict(
    type="yarn",
    rope_type="yarn",
    factor=1.0,
    original_max_position_embeddings=512,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def _base(model_type: str, **overrides: Any) -> dict[str, Any]:
    """A dense config: `_BASE` with `model_type` and `overrides` (a fresh dict each call)."""
    return {**_BASE, "model_type": model_type, **overrides}


def _moe(model_type: str, **overrides: Any) -> dict[str, Any]:
    """An MoE config: `_BASE` and `_MOE` with `model_type` and `overrides`."""
    return {**_BASE, **_MOE, "model_type": model_type, **overrides}


def _mla_moe(model_type: str, **overrides: Any) -> dict[str, Any]:
    """An MLA + MoE config (DeepSeek family): `_BASE`, `_MOE`, `_MLA` and `overrides`."""
    return {**_BASE, **_MOE, **_MLA, "model_type": model_type, **overrides}


TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "Klear": _moe("Klear"),
    "afm7": dict(
        model_type="afm7",
        vocab_size=256,
        hidden_dim=64,
        num_layers=3,
        num_kv_reuse_layers=1,
        num_heads=4,
        num_kv_heads=2,
    ),
    "afmoe": _moe(
        "afmoe",
        num_hidden_layers=3,
        num_dense_layers=1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=4,
    ),
    "apertus": _base("apertus", post_norm=False, qk_norm=True),
    "baichuan_m1": _base(
        "baichuan_m1", sliding_window=4, sliding_window_layers=[0], conv_window=2
    ),
    "bailing_hybrid": _mla_moe(
        "bailing_hybrid", layer_group_size=2, group_norm_size=2
    ),
    "bailing_moe": _moe("bailing_moe"),
    "bailing_moe_linear": _moe(
        "bailing_moe_linear", layer_group_size=2, group_norm_size=2
    ),
    "bailing_moe_v3": _mla_moe(
        "bailing_moe_v3", num_hidden_layers=2, layer_group_size=2
    ),
    "cohere": _base("cohere"),
    "cohere2": _base("cohere2", sliding_window=4, sliding_window_pattern=2),
    "dbrx": dict(
        model_type="dbrx",
        vocab_size=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
    ),
    "deepseek": _moe("deepseek"),
    "deepseek_v2": _mla_moe("deepseek_v2", num_key_value_heads=4, rope_scaling=_YARN),
    "deepseek_v3": _mla_moe("deepseek_v3", num_key_value_heads=4),
    "deepseek_v32": _mla_moe(
        "deepseek_v32",
        num_key_value_heads=4,
        index_head_dim=16,
        index_n_heads=2,
        index_topk=4,
    ),
    "deepseek_v41": _mla_moe("deepseek_v41", num_key_value_heads=4),
    "dots1": _moe("dots1"),
    "ernie4_5": _base("ernie4_5", use_bias=False),
    "ernie4_5_moe": _moe(
        "ernie4_5_moe",
        use_bias=False,
        moe_num_experts=4,
        moe_k=2,
        moe_layer_start_index=1,
        moe_num_shared_experts=1,
    ),
    "exaone": dict(_BASE, model_type="exaone", num_layers=2, layer_norm_epsilon=1e-5),
    "exaone4": _base(
        "exaone4", rope_scaling=None, sliding_window=4, sliding_window_pattern="LG"
    ),
    "exaone_moe": _moe(
        "exaone_moe",
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        is_moe_layer=[False, True],
    ),
    "falcon_h1": _base(
        "falcon_h1",
        mamba_d_ssm=64,
        mamba_d_state=8,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_chunk_size=8,
    ),
    "gear": _base(
        "gear",
        num_hidden_layers=3,
        sliding_window=4,
        layer_types=["conv_mixer", "sliding_attention", "full_attention"],
    ),
    "deepseek_v41": _mla_moe(
        "deepseek_v41",
        num_hidden_layers=3,
        num_key_value_heads=4,
        o_groups=2,
        o_lora_rank=16,
        sliding_window=4,
        compress_ratios=[0, 2, 4],
        kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[2],
        index_n_heads=2,
        index_head_dim=16,
        index_topk=2,
        candidate_topk_blocks=0,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        rms_norm_eps=1e-6,
    ),
    "gemma": _base("gemma"),
    "gemma2": _base("gemma2", query_pre_attn_scalar=16, sliding_window=4),
    "gemma3": dict(
        model_type="gemma3",
        vocab_size=256,
        text_config=_base(
            "gemma3_text",
            query_pre_attn_scalar=16,
            sliding_window=4,
            sliding_window_pattern=2,
        ),
    ),
    "gemma3_text": _base(
        "gemma3_text", query_pre_attn_scalar=16, sliding_window=4, sliding_window_pattern=2
    ),
    "gemma3n": dict(
        model_type="gemma3n",
        text_config=_base(
            "gemma3n_text",
            num_hidden_layers=3,
            num_kv_shared_layers=1,
            vocab_size_per_layer_input=256,
            sliding_window=4,
            rope_local_base_freq=10000.0,
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            activation_sparsity_pattern=[0.95, 0.0, 0.0],
            hidden_size_per_layer_input=8,
            altup_num_inputs=2,
            altup_coef_clip=120.0,
            altup_correct_scale=True,
            altup_active_idx=0,
            laurel_rank=8,
        ),
    ),
    "gemma4": dict(
        model_type="gemma4",
        vocab_size=256,
        text_config=_base(
            "gemma4_text",
            num_hidden_layers=3,
            global_head_dim=32,
            num_kv_shared_layers=1,
            vocab_size_per_layer_input=256,
            hidden_size_per_layer_input=8,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "gemma4_text": _base(
        "gemma4_text",
        num_hidden_layers=3,
        global_head_dim=32,
        num_kv_shared_layers=1,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
    "glm": _base("glm"),
    "glm4": _base("glm4", partial_rotary_factor=0.5),
    "glm4_moe": _moe(
        "glm4_moe", rope_scaling=None, use_qk_norm=True, partial_rotary_factor=0.5
    ),
    "glm4_moe_lite": _mla_moe("glm4_moe_lite", num_key_value_heads=4),
    "glm_moe_dsa": _mla_moe(
        "glm_moe_dsa",
        num_key_value_heads=4,
        index_head_dim=16,
        index_n_heads=2,
        index_topk=4,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        moe_layer_freq=1,
        rope_parameters=dict(rope_theta=10000.0, rope_type="default"),
    ),
    "gpt2": dict(
        model_type="gpt2",
        n_ctx=64,
        n_embd=64,
        n_head=4,
        n_layer=2,
        n_positions=64,
        layer_norm_epsilon=1e-5,
        vocab_size=256,
    ),
    "gpt_bigcode": dict(
        model_type="gpt_bigcode",
        n_embd=64,
        n_layer=2,
        n_inner=128,
        n_head=4,
        n_positions=64,
        layer_norm_epsilon=1e-5,
        vocab_size=256,
    ),
    "gpt_neox": _base("gpt_neox", rotary_emb_base=10000.0, rotary_pct=0.5),
    "gpt_oss": _moe(
        "gpt_oss",
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gptj": dict(
        model_type="gptj",
        n_embd=64,
        vocab_size=256,
        n_positions=64,
        n_head=4,
        rotary_dim=8,
        n_layer=2,
    ),
    "granite": _base(
        "granite",
        logits_scaling=4.0,
        attention_multiplier=0.25,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
    ),
    "granitemoe": _moe(
        "granitemoe",
        logits_scaling=4.0,
        attention_multiplier=0.25,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
    ),
    "granitemoehybrid": _moe(
        "granitemoehybrid",
        logits_scaling=4.0,
        attention_multiplier=0.25,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        layer_types=["mamba", "attention"],
        shared_intermediate_size=32,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_proj_bias=False,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_n_groups=1,
        mamba_conv_bias=True,
    ),
    "helium": _base("helium"),
    "hunyuan": _moe(
        "hunyuan",
        num_hidden_layers=3,
        moe_topk=2,
        num_shared_expert=1,
        use_mixed_mlp_moe=True,
        use_qk_norm=True,
        use_cla=True,
        cla_share_factor=2,
        rope_scaling=dict(type="dynamic", factor=1.0, alpha=1.0),
    ),
    "hunyuan_v1_dense": _base("hunyuan_v1_dense"),
    "internlm2": _base("internlm2"),
    "internlm3": _base("internlm3"),
    "iquestloopcoder": _base("iquestloopcoder"),
    "jamba": _moe(
        "jamba",
        attn_layer_offset=1,
        attn_layer_period=2,
        expert_layer_offset=1,
        expert_layer_period=2,
        mamba_d_conv=4,
        mamba_d_state=8,
        mamba_expand=2,
    ),
    "kimi_k25": dict(
        model_type="kimi_k25",
        text_config=_mla_moe("deepseek_v3", num_key_value_heads=4),
    ),
    "kimi_k3": dict(
        model_type="kimi_k3",
        text_config={
            **_mla_moe("kimi_linear", num_key_value_heads=4),
            "linear_attn_config": dict(
                kda_layers=[1], num_heads=4, head_dim=16, short_conv_kernel_size=4
            ),
            "num_experts_per_token": 2,
            "mla_use_output_gate": True,
        },
    ),
    "kimi_linear": {
        **_mla_moe("kimi_linear", num_key_value_heads=4),
        "linear_attn_config": dict(
            kda_layers=[1], num_heads=4, head_dim=16, short_conv_kernel_size=4
        ),
        "model_max_length": 512,
        "num_experts_per_token": 2,
    },
    "kimi_vl": dict(
        model_type="kimi_vl",
        text_config=_mla_moe("deepseek_v3", num_key_value_heads=4),
    ),
    "laguna": _moe(
        "laguna",
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "lfm2": _base(
        "lfm2",
        conv_bias=False,
        conv_L_cache=3,
        block_dim=64,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        block_ff_dim=128,
        full_attn_idxs=[1],
    ),
    "lfm2-vl": dict(
        model_type="lfm2-vl",
        text_config=_base(
            "lfm2",
            conv_bias=False,
            conv_L_cache=3,
            block_dim=64,
            block_multiple_of=16,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False,
            block_ff_dim=128,
            full_attn_idxs=[1],
        ),
    ),
    "lfm2_moe": _moe(
        "lfm2_moe",
        use_expert_bias=True,
        num_dense_layers=1,
        conv_bias=False,
        conv_L_cache=3,
        layer_types=["conv", "full_attention"],
    ),
    "lille-130m": dict(
        model_type="lille-130m",
        block_size=64,
        layer_norm_eps=1e-5,
        n_embd=64,
        n_head=4,
        n_kv_heads=2,
        n_layer=2,
        rope_theta=10000.0,
        vocab_size=256,
    ),
    "llama": _base("llama"),
    "llama4": dict(
        model_type="llama4",
        text_config=_moe(
            "llama4_text",
            num_hidden_layers=4,
            attention_chunk_size=4,
            interleave_moe_layer_step=2,
            num_experts_per_tok=1,
            intermediate_size=32,
            intermediate_size_mlp=128,
            rope_scaling=None,
            use_qk_norm=True,
        ),
    ),
    "llama4_text": _base(
        "llama4_text",
        intermediate_size_mlp=128,
        no_rope_layers=[1, 0],
        use_qk_norm=True,
    ),
    "longcat_flash": {
        **_MLA,
        "model_type": "longcat_flash",
        "attention_method": "MLA",
        "zero_expert_type": "identity",
        "hidden_size": 64,
        "ffn_hidden_size": 128,
        "moe_topk": 2,
        "expert_ffn_hidden_size": 32,
        "n_routed_experts": 4,
        "zero_expert_num": 2,
        "num_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "num_attention_heads": 4,
        "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "attention_bias": False,
    },
    "longcat_flash_ngram": {
        **_MLA,
        "model_type": "longcat_flash_ngram",
        "hidden_size": 64,
        "ffn_hidden_size": 128,
        "moe_topk": 2,
        "expert_ffn_hidden_size": 32,
        "n_routed_experts": 4,
        "zero_expert_num": 2,
        "num_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "num_attention_heads": 4,
        "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "ngram_vocab_size_ratio": 2,
        "emb_neighbor_num": 2,
        "emb_split_num": 2,
    },
    "mamba": _base(
        "mamba",
        state_size=8,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    ),
    "mamba2": _base(
        "mamba2",
        num_heads=4,
        head_dim=16,
        state_size=8,
        conv_kernel=4,
        n_groups=1,
        use_bias=False,
        use_conv_bias=True,
        time_step_limit=(0.0, float("inf")),
        time_step_rank=4,
    ),
    "mellum": _moe(
        "mellum",
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(
            sliding_attention=dict(rope_theta=10000.0),
            full_attention=dict(rope_theta=10000.0),
        ),
    ),
    "mimo": _base("mimo"),
    "mimo_v2_flash": _moe(
        "mimo_v2_flash",
        hybrid_layer_pattern=[1, 0],
        moe_layer_freq=[0, 1],
        add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False,
        sliding_window_size=4,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        layernorm_epsilon=1e-5,
        swa_rope_theta=10000.0,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        v_head_dim=8,
        swa_head_dim=16,
        swa_v_head_dim=8,
        partial_rotary_factor=0.5,
    ),
}
