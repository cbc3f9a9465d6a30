"""Gemma 3 (``model_type: gemma3_text``; Gemma Team 2025, "Gemma 3 Technical Report") as the
Llama family's pure step functions with Gemma's block.

What differs from Llama, each as mlx-lm's ``gemma3_text.py`` and transformers'
``modeling_gemma3.py`` compute it:

* layers are interleaved local (sliding window of ``sliding_window`` positions, RoPE base
  ``rope_local_base_freq``) and global (full attention, base ``rope_theta`` with the
  config's ``rope_scaling``): ``layer_types``, or every ``sliding_window_pattern``-th layer
  global; in the decode cache a local layer holds a ring of its window (:mod:`models.attention`);
* RMSNorm multiplies by ``1 + weight`` (the checkpoint stores ``weight``; :func:`sanitize`
  adds the 1 once at load, as llama.cpp's converter does for GGUF files);
* queries and keys get a per-head RMSNorm before RoPE, and the attention scale is
  ``query_pre_attn_scalar ** -0.5``;
* each block normalizes the attention output and the MLP output before their residual adds
  (``post_attention_layernorm``, ``post_feedforward_layernorm``) and the MLP input with
  ``pre_feedforward_layernorm``;
* the MLP is GELU(tanh approximation)-gated (Hendrycks & Gimpel 2016; "gelu_pytorch_tanh");
* embeddings are multiplied by sqrt(hidden_size) rounded to bfloat16 (Gemma's reference
  implementation computes it in bfloat16; mlx-lm does the same);
* in float16, residual sums are computed in float32 and clipped to float16's range (mlx-lm's
  ``clip_residual``: Gemma's activations overflow float16 otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx

from models import llama, model_args
from models.attention import Attend
from models.config_check import Supports
from models.kv_cache import KVCache
from models.layers import Params, embed, linear
from models.llama import Decoder, project_qkv
from models.model_args import REQUIRED_KEYS, cached_rope, scaling_items
from models.rope import RoPE, rope_type

#: transformers' default pattern: every 6th layer global (Gemma3TextConfig).
DEFAULT_PATTERN = 6


@dataclass(frozen=True)
class ModelArgs(model_args.ModelArgs):
    """Gemma 3's hyper-parameters: the Llama family's plus ``query_pre_attn_scalar`` and the
    local layers' RoPE (``rope_local_base_freq``; transformers >= 5 nests both bases and
    scalings under ``rope_parameters.{full,sliding}_attention``)."""

    query_pre_attn_scalar: float = 256.0
    rope_local_base_freq: float = 10_000.0
    rope_local_scaling: tuple[tuple[str, Any], ...] | None = None

    supports: ClassVar[Supports] = Supports(
        activations=("gelu_pytorch_tanh",),
        sliding_layer_types=True,
        biases=False,
        rope_by_layer_type=True,
        false_keys=("use_bidirectional_attention",),
    )
    # mlx-lm and transformers default these differently (1 vs 4 KV heads; 512 vs 4096 positions):
    # a config must say.
    required: ClassVar[tuple[str, ...]] = (*REQUIRED_KEYS, "num_key_value_heads", "head_dim")

    @classmethod
    def _complete(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Derive ``layer_types`` from ``sliding_window_pattern`` when absent (transformers'
        Gemma3TextConfig: layer i is global when (i + 1) % pattern == 0)."""
        if config.get("layer_types") is not None:
            return config
        pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or DEFAULT_PATTERN
        layers = int(config.get("num_hidden_layers") or 0)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        return {**config, "layer_types": types}

    @classmethod
    def _values(cls, config: dict[str, Any]) -> dict[str, Any]:
        values = super()._values({**config, "rope_parameters": None})
        values.setdefault("rope_theta", 1_000_000.0)  # transformers' default_theta["global"]
        nested = config.get("rope_parameters") or {}
        full, local = nested.get("full_attention") or {}, nested.get("sliding_attention") or {}
        if "rope_theta" in full:  # rope_parameters wins (transformers' convert_rope_params_to_dict)
            values["rope_theta"] = full["rope_theta"]
        if "rope_theta" in local:
            values["rope_local_base_freq"] = local["rope_theta"]
        if config.get("rope_scaling") is None and rope_type(full) != "default":
            values["rope_scaling"] = scaling_items(full)
        if rope_type(local) != "default":
            values["rope_local_scaling"] = scaling_items(local)
        return values

    @property
    def attention_scale(self) -> float:
        """query_pre_attn_scalar ** -0.5 (Gemma's attention scale)."""
        return self.query_pre_attn_scalar**-0.5

    def rope(self, layer: int) -> RoPE:
        """Local layers: base ``rope_local_base_freq``; global ones: ``rope_theta`` and the
        config's ``rope_scaling`` (Gemma 3 4B+ scale their global layers linearly by 8)."""
        if self.window(layer) is not None:
            return cached_rope(self.dim_per_head, self.rope_local_base_freq, False, self.rope_local_scaling)
        return cached_rope(self.dim_per_head, self.rope_theta, False, self.rope_scaling)


def _gelu_tanh(x: mx.array) -> mx.array:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _mlp(p: Params, x: mx.array, g: int) -> mx.array:
    """GELU-gated feed-forward (Shazeer 2020's GeGLU with the tanh approximation)."""
    if "gate_up_proj" in p:  # fused by models.llama.fuse_projections
        gate, up = mx.split(linear(x, p["gate_up_proj"], g), 2, axis=-1)
    else:
        gate, up = linear(x, p["gate_proj"], g), linear(x, p["up_proj"], g)
    return linear(_gelu_tanh(gate) * up, p["down_proj"], g)


def _residual(x: mx.array, y: mx.array) -> mx.array:
    """x + y; in float16 summed in float32 and clipped to float16's range (mlx-lm's clip_residual)."""
    if x.dtype != mx.float16:
        return x + y
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


def _block(
    layer: Params, x: mx.array, offset, keys: mx.array, values: mx.array, attend: Attend, args: ModelArgs, i: int
) -> tuple[mx.array, mx.array, mx.array]:
    """One Gemma 3 block (mlx-lm's ``gemma3_text.TransformerBlock``): norm -> attention ->
    norm -> residual -> norm -> MLP -> norm -> residual. Norm weights hold 1 + w already."""
    B, L, _ = x.shape
    g, eps = args.quant_group_size, args.rms_norm_eps
    h = mx.fast.rms_norm(x, layer["input_layernorm"]["weight"], eps)
    q, k, v = project_qkv(layer["self_attn"], h, args)
    rope = args.rope(i)
    o, keys, values = attend(rope(q, offset), rope(k, offset), v, keys, values)
    o = linear(o.transpose(0, 2, 1, 3).reshape(B, L, -1), layer["self_attn"]["o_proj"], g)
    h = _residual(x, mx.fast.rms_norm(o, layer["post_attention_layernorm"]["weight"], eps))
    r = _mlp(layer["mlp"], mx.fast.rms_norm(h, layer["pre_feedforward_layernorm"]["weight"], eps), g)
    return _residual(h, mx.fast.rms_norm(r, layer["post_feedforward_layernorm"]["weight"], eps)), keys, values


def _embed(params: Params, tokens: mx.array, args: ModelArgs) -> mx.array:
    """tokens int32 [B, L] -> embeddings x sqrt(H) (the factor rounded to bfloat16)."""
    x = embed(tokens, params["embed_tokens"], args.quant_group_size)
    return x * mx.array(args.hidden_size**0.5, mx.bfloat16).astype(x.dtype)


GEMMA3 = Decoder(_embed, _block, llama.final_logits)


def prefill(params: Params, tokens: mx.array, lengths: mx.array, cache: KVCache, *, args: ModelArgs):
    """:func:`models.llama.prefill` with Gemma 3's blocks (same arguments, shapes and result)."""
    return llama.run_prefill(GEMMA3, params, tokens, lengths, cache, args)


def prefill_chunk(
    params: Params, tokens: mx.array, offsets: mx.array, lengths: mx.array, cache: KVCache, *, args: ModelArgs
):
    """:func:`models.llama.prefill_chunk` with Gemma 3's blocks."""
    return llama.run_chunk(GEMMA3, params, tokens, offsets, lengths, cache, args)


def decode(params: Params, tokens: mx.array, positions: mx.array, cache: KVCache, *, args: ModelArgs):
    """:func:`models.llama.decode` with Gemma 3's blocks (local layers may hold rings)."""
    return llama.run_decode(GEMMA3, params, tokens, positions, cache, args)


def prefill_paged(
    params: Params,
    tokens: mx.array,
    offsets: mx.array,
    lengths: mx.array,
    table: mx.array,
    pool,
    *,
    args: ModelArgs,
    bits: int | None = None,
    group_size: int = 64,
):
    """:func:`models.llama.prefill_paged` with this family's blocks."""
    return llama.run_prefill_paged(GEMMA3, params, tokens, offsets, lengths, table, pool, args, bits, group_size)


def decode_paged(
    params: Params,
    tokens: mx.array,
    positions: mx.array,
    table: mx.array,
    pool,
    *,
    args: ModelArgs,
    bits: int | None = None,
    group_size: int = 64,
):
    """:func:`models.llama.decode_paged` with this family's blocks."""
    return llama.run_decode_paged(GEMMA3, params, tokens, positions, table, pool, args, bits, group_size)


def verify_paged(
    params: Params,
    tokens: mx.array,
    positions: mx.array,
    table: mx.array,
    pool,
    *,
    args: ModelArgs,
    bits: int | None = None,
    group_size: int = 64,
):
    """:func:`models.llama.verify_paged` with this family's blocks: its sliding layers verify on
    the pool, whose view is linear (their window is a mask there, not a ring)."""
    return llama.run_verify_paged(GEMMA3, params, tokens, positions, table, pool, args, bits, group_size)


#: Norms whose checkpoint weight w multiplies as (1 + w) (mlx-lm's gemma3_text.RMSNorm).
NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "q_norm",
    "k_norm",
    "norm",
)


def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """A Hugging Face / mlx-community checkpoint's tensors as the step functions take them:
    every norm weight w as 1 + w (in float32, so a bfloat16 w loses nothing), ``lm_head``
    dropped when the embeddings are tied."""
    out = llama.sanitize(weights, args)
    for key, value in out.items():
        if key.endswith(".weight") and key.rsplit(".", 2)[-2] in NORMS:
            out[key] = value.astype(mx.float32) + 1.0
    return out


def unshift_norms(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The inverse of :func:`sanitize`'s shift: norm weights 1 + w back to w (for writing a
    checkpoint that mlx-lm and transformers read)."""
    return {k: (v - 1.0 if k.endswith(".weight") and k.rsplit(".", 2)[-2] in NORMS else v) for k, v in weights.items()}
