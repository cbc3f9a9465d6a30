"""Llama-family decoder (Llama, SmolLM, Mistral layouts) as pure, batched step functions.

The parameters are a plain nested dict of arrays (``params``), never a module, so that
MLX compilation sees them as inputs and nothing is captured as a constant. The only Python
values frozen into a traced function are the hyper-parameters in :class:`ModelArgs` and the
array *shapes* of one bucket; positions and lengths are always ``mx.array`` inputs.

Shapes use: B batch rows (a batch bucket), T prompt tokens (a prompt bucket), C KV capacity
(a capacity bucket), H hidden size, V vocabulary, Hq/Hkv query/key-value heads, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import mlx.core as mx

from models.kv_cache import KVCache

Params = dict[str, Any]


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of a Llama-family decoder.

    Field names follow the Hugging Face / mlx-lm ``config.json`` convention so that
    :meth:`from_dict` takes such a config unchanged (unknown keys are ignored).
    ``rope_traditional`` selects MLX's interleaved RoPE (pairs ``(2i, 2i+1)``), which is the
    layout of Q/K rows in llama.cpp GGUF files (convert_hf_to_gguf.py permutes them); the
    Hugging Face layout uses the non-interleaved form (``False``).
    """

    model_type: str = "llama"
    hidden_size: int = 576
    num_hidden_layers: int = 30
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    rms_norm_eps: float = 1e-5
    vocab_size: int = 49152
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    head_dim: int | None = None
    quant_group_size: int = 32

    @classmethod
    def from_dict(cls, config: dict) -> ModelArgs:
        """Build from a ``config.json`` dict, ignoring keys this class does not know.

        ``rope_theta`` may be nested under ``rope_parameters`` (transformers >= 5), and the
        quantization group size comes from ``quantization.group_size`` (mlx-lm's format).
        """
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in config.items() if k in names}
        rope = config.get("rope_parameters") or {}
        if "rope_theta" not in values and "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        if isinstance(config.get("quantization"), dict):
            values["quant_group_size"] = config["quantization"].get("group_size", 64)
        return cls(**values)

    @property
    def dim_per_head(self) -> int:
        """D: the attention head dimension (``head_dim`` or hidden_size / heads)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads


# ---------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------


def _bits(p: Params, group_size: int) -> int:
    """Bits per weight of a quantized triple, from its (static) shapes."""
    in_features = p["scales"].shape[-1] * group_size
    return p["weight"].shape[-1] * 32 // in_features


def linear(x: mx.array, p: Params, group_size: int = 32) -> mx.array:
    """``x @ W.T (+ bias)`` for a dense or MLX affine-quantized weight.

    ``p`` holds ``weight`` [out, in] (dense) or ``weight`` [out, in*bits/32] uint32 with
    ``scales``/``biases`` [out, in/group_size] (MLX affine quantization, ``mx.quantize``);
    optional ``bias`` [out]. x: [..., in] -> [..., out].
    """
    if "scales" in p:
        out = mx.quantized_matmul(
            x,
            p["weight"],
            p["scales"],
            p["biases"],
            transpose=True,
            group_size=group_size,
            bits=_bits(p, group_size),
        )
    else:
        out = x @ p["weight"].T
    return out + p["bias"] if "bias" in p else out


def embed(tokens: mx.array, p: Params, group_size: int = 32) -> mx.array:
    """Look up embeddings. tokens: int32 [...] -> [..., H] in the table's (scales') dtype."""
    w = p["weight"]
    if "scales" not in p:
        return w[tokens]
    return mx.dequantize(
        w[tokens],
        p["scales"][tokens],
        p["biases"][tokens],
        group_size=group_size,
        bits=_bits(p, group_size),
    )


def _mlp(p: Params, x: mx.array, g: int) -> mx.array:
    """SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer")."""
    if "gate_up_proj" in p:  # fused by :func:`fuse_projections`: one matmul, then a split
        gate, up = mx.split(linear(x, p["gate_up_proj"], g), 2, axis=-1)
    else:
        gate, up = linear(x, p["gate_proj"], g), linear(x, p["up_proj"], g)
    return linear(gate * mx.sigmoid(gate) * up, p["down_proj"], g)


def _project_qkv(p: Params, x: mx.array, args: ModelArgs):
    """x [B, L, H] -> q [B, Hq, L, D], k and v [B, Hkv, L, D].

    Optional parts follow the parameters present: ``bias`` on the projections (Qwen2) and
    ``q_norm``/``k_norm`` (Qwen3), so one function serves the Llama family.
    """
    B, L, _ = x.shape
    D, g = args.dim_per_head, args.quant_group_size
    Hq, Hkv = args.num_attention_heads, args.num_key_value_heads
    if "qkv_proj" in p:  # fused by :func:`fuse_projections`: one matmul, then a split
        q, k, v = mx.split(linear(x, p["qkv_proj"], g), [Hq * D, (Hq + Hkv) * D], axis=-1)
    else:
        q, k, v = linear(x, p["q_proj"], g), linear(x, p["k_proj"], g), linear(x, p["v_proj"], g)
    q, k, v = q.reshape(B, L, Hq, D), k.reshape(B, L, Hkv, D), v.reshape(B, L, Hkv, D)
    if "q_norm" in p:  # Qwen3: RMSNorm over each head's D values before RoPE
        q = mx.fast.rms_norm(q, p["q_norm"]["weight"], args.rms_norm_eps)
        k = mx.fast.rms_norm(k, p["k_norm"]["weight"], args.rms_norm_eps)
    return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def fuse_projections(params: Params) -> Params:
    """Concatenate each layer's Q, K and V projections into ``qkv_proj`` and the MLP's gate
    and up projections into ``gate_up_proj`` along the output axis, so that a step runs one
    matmul where it ran three (or two): fewer kernel launches per token, which is most of a
    small model's decode time on a GPU. The step functions split the result back, so the
    outputs are the same up to the matmul's own rounding.

    Works for dense weights [out, in] and MLX affine-quantized triples (``weight``,
    ``scales``, ``biases`` are all per output row); ``bias`` vectors are concatenated too.
    A group whose members differ in format (dense vs quantized, bit width, present keys) is
    left unfused. Returns a new tree; ``params`` is not modified.
    """

    def fuse(block: Params, names: tuple[str, ...], fused: str) -> Params:
        parts = [block.get(n) for n in names]
        if any(not isinstance(p, dict) for p in parts):
            return block
        keys = set(parts[0])
        if any(set(p) != keys for p in parts) or any(
            p[k].dtype != parts[0][k].dtype or p[k].shape[1:] != parts[0][k].shape[1:] for p in parts for k in keys
        ):
            return block
        out = {k: v for k, v in block.items() if k not in names}
        out[fused] = {k: mx.concatenate([p[k] for p in parts], axis=0) for k in keys}
        return out

    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        layer["self_attn"] = fuse(layer["self_attn"], ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        layer["mlp"] = fuse(layer["mlp"], ("gate_proj", "up_proj"), "gate_up_proj")
        layers.append(layer)
    return {**params, "layers": layers}


def _rope(x: mx.array, offset, args: ModelArgs) -> mx.array:
    """Rotary embedding (Su et al. 2021). offset: int 0 or int32 [B] start positions."""
    return mx.fast.rope(
        x,
        args.dim_per_head,
        traditional=args.rope_traditional,
        base=args.rope_theta,
        scale=1.0,
        offset=offset,
    )


def _final_logits(params: Params, h: mx.array, args: ModelArgs) -> mx.array:
    """h [B, H] -> float32 logits [B, V]."""
    h = mx.fast.rms_norm(h, params["norm"]["weight"], args.rms_norm_eps)
    head = params.get("lm_head", params["embed_tokens"])
    return linear(h, head, args.quant_group_size).astype(mx.float32)


# ---------------------------------------------------------------------------------------
# The two step functions
# ---------------------------------------------------------------------------------------


def prefill(
    params: Params, tokens: mx.array, lengths: mx.array, cache: KVCache, *, args: ModelArgs
) -> tuple[mx.array, KVCache]:
    """Run the prompt through the model and fill the KV cache from position 0.

    Args:
        params: the model's parameter tree (see :func:`models.gguf.load_gguf`).
        tokens: int32 [B, T], prompts right-padded to the prompt bucket T.
        lengths: int32 [B], real prompt lengths (1 <= lengths <= T); padded rows use 1.
        cache: KV cache of capacity C >= T; positions 0..T-1 are overwritten.
        args: hyper-parameters (static).

    Returns:
        (logits float32 [B, V] at each row's last real token, the updated cache).
        Keys written for padded positions (>= length) are garbage; decode masks them out
        by position, and each later token overwrites one of them.
    """
    B, T = tokens.shape
    x = embed(tokens, params["embed_tokens"], args.quant_group_size)
    scale = 1.0 / math.sqrt(args.dim_per_head)
    new_keys, new_values = [], []
    for i, layer in enumerate(params["layers"]):
        h = mx.fast.rms_norm(x, layer["input_layernorm"]["weight"], args.rms_norm_eps)
        q, k, v = _project_qkv(layer["self_attn"], h, args)
        q, k = _rope(q, 0, args), _rope(k, 0, args)
        # Causal attention within the prompt: a real query only sees earlier (real) keys.
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        o = o.transpose(0, 2, 1, 3).reshape(B, T, -1)
        x = x + linear(o, layer["self_attn"]["o_proj"], args.quant_group_size)
        h = mx.fast.rms_norm(x, layer["post_attention_layernorm"]["weight"], args.rms_norm_eps)
        x = x + _mlp(layer["mlp"], h, args.quant_group_size)
        new_keys.append(_write_prefix(cache.keys[i], k))
        new_values.append(_write_prefix(cache.values[i], v))
    last = mx.take_along_axis(x, (lengths - 1).astype(mx.int32)[:, None, None], axis=1)
    return _final_logits(params, last[:, 0, :], args), KVCache(new_keys, new_values)


def _write_prefix(buf: mx.array, new: mx.array) -> mx.array:
    """Write new [B, Hkv, T, D] into buf [B, Hkv, C, D] at positions 0..T-1 (C >= T)."""
    T, C = new.shape[2], buf.shape[2]
    if T == C:
        return new.astype(buf.dtype)
    return mx.concatenate([new.astype(buf.dtype), buf[:, :, T:, :]], axis=2)


def decode(
    params: Params, tokens: mx.array, positions: mx.array, cache: KVCache, *, args: ModelArgs
) -> tuple[mx.array, KVCache]:
    """One decode step for every row of the batch.

    Args:
        params: the model's parameter tree.
        tokens: int32 [B], each row's newest token.
        positions: int32 [B], the position of that token (= tokens already in the cache).
            Must be < C. Empty slots pass 0 and a dummy token; their result is ignored.
        cache: KV cache [B, Hkv, C, D] per layer.
        args: hyper-parameters (static).

    Returns:
        (logits float32 [B, V], the cache with each row's key/value written at its position).
        Row b attends to cache positions 0..positions[b] only, so padding rows, stale entries
        and other rows never influence it.
    """
    B = tokens.shape[0]
    C = cache.capacity
    x = embed(tokens[:, None], params["embed_tokens"], args.quant_group_size)  # [B, 1, H]
    scale = 1.0 / math.sqrt(args.dim_per_head)
    mask = (mx.arange(C)[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, C]
    index = positions.astype(mx.int32)[:, None, None, None]  # [B, 1, 1, 1]
    new_keys, new_values = [], []
    for i, layer in enumerate(params["layers"]):
        h = mx.fast.rms_norm(x, layer["input_layernorm"]["weight"], args.rms_norm_eps)
        q, k, v = _project_qkv(layer["self_attn"], h, args)  # [B, H*, 1, D]
        q, k = _rope(q, positions, args), _rope(k, positions, args)
        keys = mx.put_along_axis(cache.keys[i], mx.broadcast_to(index, k.shape), k.astype(cache.dtype), axis=2)
        values = mx.put_along_axis(cache.values[i], mx.broadcast_to(index, v.shape), v.astype(cache.dtype), axis=2)
        new_keys.append(keys)
        new_values.append(values)
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
        o = o.transpose(0, 2, 1, 3).reshape(B, 1, -1)
        x = x + linear(o, layer["self_attn"]["o_proj"], args.quant_group_size)
        h = mx.fast.rms_norm(x, layer["post_attention_layernorm"]["weight"], args.rms_norm_eps)
        x = x + _mlp(layer["mlp"], h, args.quant_group_size)
    return _final_logits(params, x[:, 0, :], args), KVCache(new_keys, new_values)


def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """Drop checkpoint tensors the step functions do not use: precomputed RoPE frequencies,
    and ``lm_head`` when the embeddings are tied (mlx-lm's llama.sanitize does the same)."""
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    if args.tie_word_embeddings:
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    return weights
