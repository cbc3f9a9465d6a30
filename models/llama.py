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
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import mlx.core as mx

from models.config_check import unimplemented_config
from models.kv_cache import KVCache
from models.layers import Params, embed, linear

#: Keys a ``config.json`` must have: without them the model's shape is unknown (mlx-lm's
#: llama.ModelArgs requires the same ones).
REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "rms_norm_eps",
    "vocab_size",
)


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of a Llama-family decoder.

    Field names follow the Hugging Face / mlx-lm ``config.json`` convention so that
    :meth:`from_dict` takes such a config unchanged. ``rope_traditional`` selects MLX's
    interleaved RoPE (pairs ``(2i, 2i+1)``), which is the layout of Q/K rows in llama.cpp
    GGUF files (convert_hf_to_gguf.py permutes them); the Hugging Face layout uses the
    non-interleaved form (``False``).
    """

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    model_type: str = "llama"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    head_dim: int | None = None
    quant_group_size: int = 32

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """Build from a ``config.json`` dict.

        Keys that do not change the computation are ignored (mlx-lm's convention); keys
        that would change it in a way stepserve does not implement are refused
        (:func:`models.config_check.unimplemented_config`). ``num_key_value_heads``
        defaults to ``num_attention_heads`` (Hugging Face's default), ``rope_theta`` may be
        nested under ``rope_parameters`` (transformers >= 5), and the quantization group
        size comes from ``quantization.group_size`` (mlx-lm's format).

        Raises:
            ValueError: a key in :data:`REQUIRED_KEYS` is missing, or the config asks for
                something not implemented; the message names every such key and value.
        """
        problems = [f"'{k}' is missing (required)" for k in REQUIRED_KEYS if k not in config]
        problems += unimplemented_config(config)
        if problems:
            raise ValueError("; ".join(problems))
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in config.items() if k in names and v is not None}
        values.setdefault("num_key_value_heads", config["num_attention_heads"])
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


def _mlp(p: Params, x: mx.array, g: int) -> mx.array:
    """SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer")."""
    if "gate_up_proj" in p:  # fused by :func:`fuse_projections`: one matmul, then a split
        gate, up = mx.split(linear(x, p["gate_up_proj"], g), 2, axis=-1)
    else:
        gate, up = linear(x, p["gate_proj"], g), linear(x, p["up_proj"], g)
    return linear(gate * mx.sigmoid(gate) * up, p["down_proj"], g)


def _project_qkv(p: Params, x: mx.array, args: ModelArgs) -> tuple[mx.array, mx.array, mx.array]:
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
    matmul where it ran three (or two): fewer kernel launches per token. The step functions
    split the result back, so the outputs are the same up to the matmul's own rounding.

    Works for dense weights [out, in] and MLX affine-quantized triples (``weight``,
    ``scales``, ``biases`` are all per output row); ``bias`` vectors are concatenated too.
    A group whose members differ in format (dense vs quantized, bit width, present keys) is
    left unfused. Returns a new tree; ``params`` is not modified.
    """

    def fuse(block: Params, names: tuple[str, ...], fused: str) -> Params:
        parts: list[Params] = [block[n] for n in names if isinstance(block.get(n), dict)]
        if len(parts) != len(names):
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


def _rope(x: mx.array, offset: int | mx.array, args: ModelArgs) -> mx.array:
    """Rotary embedding (Su et al. 2021). offset: int 0 or int32 [B] start positions."""
    return mx.fast.rope(
        x,
        args.dim_per_head,
        traditional=args.rope_traditional,
        base=args.rope_theta,
        scale=1.0,
        offset=offset,
    )


def _attention_scale(args: ModelArgs) -> float:
    """1/sqrt(D), the scaled dot-product attention scale (Vaswani et al. 2017)."""
    return 1.0 / math.sqrt(args.dim_per_head)


def _final_logits(params: Params, h: mx.array, args: ModelArgs) -> mx.array:
    """h [B, H] -> float32 logits [B, V]."""
    h = mx.fast.rms_norm(h, params["norm"]["weight"], args.rms_norm_eps)
    head = params.get("lm_head", params["embed_tokens"])
    return linear(h, head, args.quant_group_size).astype(mx.float32)


# ---------------------------------------------------------------------------------------
# One transformer block, two ways to attend, the two step functions
# ---------------------------------------------------------------------------------------

#: One layer's attention and cache update, the only part prefill and decode do differently:
#: (q [B, Hq, L, D], k and v [B, Hkv, L, D] after RoPE, the layer's cache keys and values
#: [B, Hkv, C, D]) -> (output [B, Hq, L, D], the new cache keys, the new cache values).
Attend = Callable[[mx.array, mx.array, mx.array, mx.array, mx.array], tuple[mx.array, mx.array, mx.array]]


def _block(
    layer: Params,
    x: mx.array,
    offset: int | mx.array,
    keys: mx.array,
    values: mx.array,
    attend: Attend,
    args: ModelArgs,
) -> tuple[mx.array, mx.array, mx.array]:
    """One pre-norm decoder block (mlx-lm's ``llama.TransformerBlock``): norm -> attention ->
    residual -> norm -> MLP -> residual.

    x [B, L, H]; offset: RoPE start position, int 0 or int32 [B]; keys/values: this layer's
    cache [B, Hkv, C, D]. Returns (x [B, L, H], new keys, new values).
    """
    B, L, _ = x.shape
    g, eps = args.quant_group_size, args.rms_norm_eps
    h = mx.fast.rms_norm(x, layer["input_layernorm"]["weight"], eps)
    q, k, v = _project_qkv(layer["self_attn"], h, args)
    q, k = _rope(q, offset, args), _rope(k, offset, args)
    o, keys, values = attend(q, k, v, keys, values)
    o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
    x = x + linear(o, layer["self_attn"]["o_proj"], g)
    h = mx.fast.rms_norm(x, layer["post_attention_layernorm"]["weight"], eps)
    return x + _mlp(layer["mlp"], h, g), keys, values


def _blocks(
    params: Params, x: mx.array, offset: int | mx.array, cache: KVCache, attend: Attend, args: ModelArgs
) -> tuple[mx.array, KVCache]:
    """Every layer's :func:`_block` in turn. x [B, L, H] -> (x [B, L, H], the new cache)."""
    new_keys, new_values = [], []
    for layer, keys, values in zip(params["layers"], cache.keys, cache.values, strict=True):
        x, keys, values = _block(layer, x, offset, keys, values, attend, args)
        new_keys.append(keys)
        new_values.append(values)
    return x, KVCache(new_keys, new_values)


def _attend_prompt(
    q: mx.array, k: mx.array, v: mx.array, keys: mx.array, values: mx.array, *, scale: float
) -> tuple[mx.array, mx.array, mx.array]:
    """Prefill's :data:`Attend`: causal attention within the prompt (a real query only sees
    earlier, real keys), and k/v [B, Hkv, T, D] written at cache positions 0..T-1."""
    o = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    return o, _write_prefix(keys, k), _write_prefix(values, v)


def _write_prefix(buf: mx.array, new: mx.array) -> mx.array:
    """Write new [B, Hkv, T, D] into buf [B, Hkv, C, D] at positions 0..T-1 (C >= T)."""
    T, C = new.shape[2], buf.shape[2]
    if T == C:
        return new.astype(buf.dtype)
    return mx.concatenate([new.astype(buf.dtype), buf[:, :, T:, :]], axis=2)


def _attend_cache(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    index: mx.array,
    mask: mx.array,
    scale: float,
) -> tuple[mx.array, mx.array, mx.array]:
    """Decode's and a prompt chunk's :data:`Attend`: row b's k/v [B, Hkv, L, D] scattered at its
    positions (index: int32 [B, 1, L, 1]; decode L = 1), then attention over the whole cache,
    query l of row b masked to positions 0..its own (mask: bool [B, 1, L, C]): for a chunk, the
    cached prefix and the chunk's earlier tokens."""
    keys = mx.put_along_axis(keys, mx.broadcast_to(index, k.shape), k.astype(keys.dtype), axis=2)
    values = mx.put_along_axis(values, mx.broadcast_to(index, v.shape), v.astype(values.dtype), axis=2)
    o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return o, keys, values


def prefill_chunk(
    params: Params, tokens: mx.array, offsets: mx.array, lengths: mx.array, cache: KVCache, *, args: ModelArgs
) -> tuple[mx.array, KVCache]:
    """Prefill a chunk of each row's prompt on top of what its cache already holds.

    Chunked prefill (Agrawal et al. 2023, "SARATHI"; vLLM's chunked prefill) and prefix-cache
    hits both continue a prompt from an offset: the cache's positions 0..offsets[b]-1 already
    hold row b's earlier keys and values.

    Args:
        params: the model's parameter tree.
        tokens: int32 [B, T], each row's next prompt tokens, right-padded to the chunk bucket T.
        offsets: int32 [B], where each row's chunk starts (tokens already in its cache).
        lengths: int32 [B], real tokens in each row's chunk (1 <= lengths <= T).
        cache: KV cache [B, Hkv, C, D] per layer, with offsets[b] + T <= C for every row.
        args: hyper-parameters (static).

    Returns:
        (logits float32 [B, V] at each row's last real token of the chunk, the cache with the
        chunk's keys and values written at offsets[b]..offsets[b]+T-1). Positions written for
        padding (>= offsets + lengths) are garbage that decode masks and later overwrites.
    """
    T, C = tokens.shape[1], cache.capacity
    x = embed(tokens, params["embed_tokens"], args.quant_group_size)  # [B, T, H]
    positions = offsets[:, None] + mx.arange(T)[None, :]  # [B, T]
    index = positions.astype(mx.int32)[:, None, :, None]  # [B, 1, T, 1]
    mask = (mx.arange(C)[None, None, :] <= positions[:, :, None])[:, None, :, :]  # [B, 1, T, C]
    attend = partial(_attend_cache, index=index, mask=mask, scale=_attention_scale(args))
    x, cache = _blocks(params, x, offsets, cache, attend, args)
    last = mx.take_along_axis(x, (lengths - 1).astype(mx.int32)[:, None, None], axis=1)  # [B, 1, H]
    return _final_logits(params, last[:, 0, :], args), cache


def prefill(
    params: Params, tokens: mx.array, lengths: mx.array, cache: KVCache, *, args: ModelArgs
) -> tuple[mx.array, KVCache]:
    """Run the prompt through the model and fill the KV cache from position 0.

    Args:
        params: the model's parameter tree (see :func:`models.loader.load_model`).
        tokens: int32 [B, T], prompts right-padded to the prompt bucket T.
        lengths: int32 [B], real prompt lengths (1 <= lengths <= T); padded rows use 1.
        cache: KV cache of capacity C >= T; positions 0..T-1 are overwritten.
        args: hyper-parameters (static).

    Returns:
        (logits float32 [B, V] at each row's last real token, the updated cache).
        Keys written for padded positions (>= length) are garbage; decode masks them out
        by position, and each later token overwrites one of them.
    """
    x = embed(tokens, params["embed_tokens"], args.quant_group_size)  # [B, T, H]
    attend = partial(_attend_prompt, scale=_attention_scale(args))
    x, cache = _blocks(params, x, 0, cache, attend, args)
    last = mx.take_along_axis(x, (lengths - 1).astype(mx.int32)[:, None, None], axis=1)  # [B, 1, H]
    return _final_logits(params, last[:, 0, :], args), cache


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
    x = embed(tokens[:, None], params["embed_tokens"], args.quant_group_size)  # [B, 1, H]
    mask = (mx.arange(cache.capacity)[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, C]
    index = positions.astype(mx.int32)[:, None, None, None]  # [B, 1, 1, 1]
    attend = partial(_attend_cache, index=index, mask=mask, scale=_attention_scale(args))
    x, cache = _blocks(params, x, positions, cache, attend, args)
    return _final_logits(params, x[:, 0, :], args), cache


def verify(
    params: Params, tokens: mx.array, positions: mx.array, cache: KVCache, *, args: ModelArgs
) -> tuple[mx.array, KVCache]:
    """Score each row's last accepted token and its proposed continuation in one step
    (speculative decoding's verification pass: Leviathan et al. 2023, "Fast Inference from
    Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language
    Model Decoding with Speculative Sampling").

    :func:`prefill_chunk` at the decode cache's (B, C), returning the logits of every
    position rather than of the last one.

    Args:
        params: the model's parameter tree.
        tokens: int32 [B, K+1]: row b's newest token, then up to K proposed tokens, padded
            (rows that propose fewer, or nothing, ride along; their padding is ignored).
        positions: int32 [B], the position of each row's newest token (= tokens in its cache);
            positions[b] + K < C for every row, empty slots included (they pass 0).
        cache: KV cache [B, Hkv, C, D] per layer.
        args: hyper-parameters (static).

    Returns:
        (logits float32 [B, K+1, V]: entry j scores the token after tokens[b, j]; the cache
        with tokens[b, j]'s key and value written at positions[b] + j). Query j of row b
        attends to positions 0..positions[b] + j, so a rejected proposal's key and value are
        garbage past the row's new position, masked until a later step overwrites them: a
        rejection is undone by position arithmetic alone.
    """
    L, C = tokens.shape[1], cache.capacity
    x = embed(tokens, params["embed_tokens"], args.quant_group_size)  # [B, L, H]
    at = positions[:, None] + mx.arange(L)[None, :]  # [B, L]
    index = at.astype(mx.int32)[:, None, :, None]  # [B, 1, L, 1]
    mask = (mx.arange(C)[None, None, :] <= at[:, :, None])[:, None, :, :]  # [B, 1, L, C]
    attend = partial(_attend_cache, index=index, mask=mask, scale=_attention_scale(args))
    x, cache = _blocks(params, x, positions, cache, attend, args)
    B, _, H = x.shape
    logits = _final_logits(params, x.reshape(B * L, H), args)
    return logits.reshape(B, L, -1), cache


def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """Drop checkpoint tensors the step functions do not use: precomputed RoPE frequencies,
    and ``lm_head`` when the embeddings are tied (mlx-lm's llama.sanitize does the same)."""
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    if args.tie_word_embeddings:
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    return weights
