"""Llama-family decoder (Llama, SmolLM, Mistral layouts) as pure, batched step functions.

The parameters are a plain nested dict of arrays (``params``), never a module, so that
MLX compilation sees them as inputs and nothing is captured as a constant. The only Python
values frozen into a traced function are the hyper-parameters in :class:`ModelArgs` and the
array *shapes* of one bucket; positions and lengths are always ``mx.array`` inputs.

Shapes use: B batch rows (a batch bucket), T prompt tokens (a prompt bucket), C KV capacity
(a capacity bucket), H hidden size, V vocabulary, Hq/Hkv query/key-value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import mlx.core as mx

from models.attention import Attend, CacheAttention, PromptAttention
from models.fuse import fuse_projections
from models.kv_cache import KVCache
from models.layers import Params, embed, linear
from models.model_args import ModelArgs
from models.paged import PagedKV, paged_attention

#: A static cache or a paged pool: :func:`run_blocks` returns what it was given.
Cache = TypeVar("Cache", KVCache, PagedKV)

# ---------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------


def swiglu_mlp(p: Params, x: mx.array, g: int) -> mx.array:
    """SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer")."""
    if "gate_up_proj" in p:  # fused by :func:`models.fuse.fuse_projections`: one matmul, then a split
        gate, up = mx.split(linear(x, p["gate_up_proj"], g), 2, axis=-1)
    else:
        gate, up = linear(x, p["gate_proj"], g), linear(x, p["up_proj"], g)
    return linear(gate * mx.sigmoid(gate) * up, p["down_proj"], g)


def project_qkv(p: Params, x: mx.array, args: ModelArgs) -> tuple[mx.array, mx.array, mx.array]:
    """x [B, L, H] -> q [B, Hq, L, D], k and v [B, Hkv, L, D].

    Optional parts follow the parameters present: ``bias`` on the projections (Qwen2) and
    ``q_norm``/``k_norm`` (Qwen3), so one function serves the Llama family.
    """
    B, L, _ = x.shape
    D, g = args.dim_per_head, args.quant_group_size
    Hq, Hkv = args.num_attention_heads, args.num_key_value_heads
    if "qkv_proj" in p:  # fused by :func:`models.fuse.fuse_projections`: one matmul, then a split
        q, k, v = mx.split(linear(x, p["qkv_proj"], g), [Hq * D, (Hq + Hkv) * D], axis=-1)
    else:
        q, k, v = linear(x, p["q_proj"], g), linear(x, p["k_proj"], g), linear(x, p["v_proj"], g)
    q, k, v = q.reshape(B, L, Hq, D), k.reshape(B, L, Hkv, D), v.reshape(B, L, Hkv, D)
    if "q_norm" in p:  # Qwen3: RMSNorm over each head's D values before RoPE
        q = mx.fast.rms_norm(q, p["q_norm"]["weight"], args.rms_norm_eps)
        k = mx.fast.rms_norm(k, p["k_norm"]["weight"], args.rms_norm_eps)
    return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def final_logits(params: Params, h: mx.array, args: ModelArgs) -> mx.array:
    """h [B, H] -> float32 logits [B, V]."""
    h = mx.fast.rms_norm(h, params["norm"]["weight"], args.rms_norm_eps)
    head = params.get("lm_head", params["embed_tokens"])
    return linear(h, head, args.quant_group_size).astype(mx.float32)


def embed_tokens(params: Params, tokens: mx.array, args: ModelArgs) -> mx.array:
    """tokens int32 [B, L] -> x [B, L, H]."""
    return embed(tokens, params["embed_tokens"], args.quant_group_size)


# ---------------------------------------------------------------------------------------
# One transformer block, and the three step functions over any family's blocks
# ---------------------------------------------------------------------------------------

#: One decoder block: (its parameters, x [B, L, H], RoPE offset int 0 or int32 [B], its cache
#: keys and values [B, Hkv, S, D], its :data:`models.attention.Attend`, args, layer index)
#: -> (x [B, L, H], new keys, new values).
Block = Callable[[Params, mx.array, Any, mx.array, mx.array, Attend, Any, int], tuple[mx.array, mx.array, mx.array]]


def attention_residual(
    layer: Params, x: mx.array, offset: int | mx.array, keys: mx.array, values: mx.array, attend: Attend, args, i: int
) -> tuple[mx.array, mx.array, mx.array]:
    """The attention half of a pre-norm block: x + o_proj(attention(RoPE(q), RoPE(k), v)) over
    ``input_layernorm(x)``, layer ``i``'s RoPE being ``args.rope(i)``. Returns (x [B, L, H],
    new keys, new values)."""
    B, L, _ = x.shape
    h = mx.fast.rms_norm(x, layer["input_layernorm"]["weight"], args.rms_norm_eps)
    q, k, v = project_qkv(layer["self_attn"], h, args)
    rope = args.rope(i)
    o, keys, values = attend(rope(q, offset), rope(k, offset), v, keys, values)
    o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
    return x + linear(o, layer["self_attn"]["o_proj"], args.quant_group_size), keys, values


def _block(
    layer: Params, x: mx.array, offset: int | mx.array, keys: mx.array, values: mx.array, attend: Attend, args, i: int
) -> tuple[mx.array, mx.array, mx.array]:
    """One pre-norm decoder block (mlx-lm's ``llama.TransformerBlock``): norm -> attention ->
    residual -> norm -> MLP -> residual."""
    x, keys, values = attention_residual(layer, x, offset, keys, values, attend, args, i)
    h = mx.fast.rms_norm(x, layer["post_attention_layernorm"]["weight"], args.rms_norm_eps)
    return x + swiglu_mlp(layer["mlp"], h, args.quant_group_size), keys, values


@dataclass(frozen=True)
class Decoder:
    """What distinguishes a decoder family's forward pass: its embedding (tokens int32
    [B, L] -> x [B, L, H]), its :data:`Block` and its head (h [B, H] -> float32 logits
    [B, V]). The step functions below run any family's."""

    embed: Callable[[Params, mx.array, Any], mx.array]
    block: Block
    logits: Callable[[Params, mx.array, Any], mx.array]


LLAMA = Decoder(embed_tokens, _block, final_logits)


def run_blocks(
    decoder: Decoder, params: Params, x: mx.array, offset, cache: Cache, attention, args
) -> tuple[mx.array, Cache]:
    """Every layer's block in turn, layer i attending with ``attention(args.window(i))`` (an
    :class:`models.attention.PromptAttention` or :class:`models.attention.CacheAttention`) and
    RoPE ``offset`` (int 0, or int32 [B]). x [B, L, H] -> (x [B, L, H], the new cache). The
    step functions here and a pipeline stage's (:mod:`models.pipeline`) run their layers with it.
    ``cache`` may be a paged pool (:class:`models.paged.PagedKV`, with a
    :class:`models.paged.PagedAttention`): the result is then the new pools."""
    new_keys, new_values = [], []
    for i, (layer, keys, values) in enumerate(zip(params["layers"], cache.keys, cache.values, strict=True)):
        x, keys, values = decoder.block(layer, x, offset, keys, values, attention(args.window(i)), args, i)
        new_keys.append(keys)
        new_values.append(values)
    if isinstance(cache, PagedKV):
        return x, PagedKV(new_keys, new_values)
    return x, KVCache(new_keys, new_values)


def run_chunk(
    decoder: Decoder, params: Params, tokens: mx.array, offsets: mx.array, lengths: mx.array, cache: KVCache, args
) -> tuple[mx.array, KVCache]:
    """:func:`prefill_chunk` for ``decoder``'s family."""
    T = tokens.shape[1]
    x = decoder.embed(params, tokens, args)  # [B, T, H]
    positions = offsets[:, None] + mx.arange(T)[None, :]  # [B, T]
    x, cache = run_blocks(decoder, params, x, offsets, cache, CacheAttention(positions, args.attention_scale), args)
    last = mx.take_along_axis(x, (lengths - 1).astype(mx.int32)[:, None, None], axis=1)  # [B, 1, H]
    return decoder.logits(params, last[:, 0, :], args), cache


def run_prefill(
    decoder: Decoder, params: Params, tokens: mx.array, lengths: mx.array, cache: KVCache, args
) -> tuple[mx.array, KVCache]:
    """:func:`prefill` for ``decoder``'s family."""
    x = decoder.embed(params, tokens, args)  # [B, T, H]
    x, cache = run_blocks(decoder, params, x, 0, cache, PromptAttention(tokens.shape[1], args.attention_scale), args)
    last = mx.take_along_axis(x, (lengths - 1).astype(mx.int32)[:, None, None], axis=1)  # [B, 1, H]
    return decoder.logits(params, last[:, 0, :], args), cache


def run_decode(
    decoder: Decoder, params: Params, tokens: mx.array, positions: mx.array, cache: KVCache, args
) -> tuple[mx.array, KVCache]:
    """:func:`decode` for ``decoder``'s family."""
    x = decoder.embed(params, tokens[:, None], args)  # [B, 1, H]
    attention = CacheAttention(positions[:, None], args.attention_scale)
    x, cache = run_blocks(decoder, params, x, positions, cache, attention, args)
    return decoder.logits(params, x[:, 0, :], args), cache


def run_paged(
    decoder: Decoder,
    params: Params,
    tokens: mx.array,
    positions: mx.array,
    table: mx.array,
    pool: PagedKV,
    args,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, PagedKV]:
    """The blocks of a paged step of L tokens per row, shared by :func:`decode_paged` (L = 1)
    and :func:`verify_paged`: row b's tokens ``tokens[b]`` (int32 [B, L]) go at positions
    ``positions[b]``..``positions[b] + L - 1`` (each below M * bt) of its blocks ``table[b]``
    (int32 [B, M]), query l seeing positions 0..positions[b] + l (its last W on a sliding
    layer). Returns (the last hidden states x [B, L, H], before the final norm; the new pools)."""
    L = tokens.shape[1]
    x = decoder.embed(params, tokens, args)  # [B, L, H]
    at = positions[:, None] + mx.arange(L, dtype=mx.int32)[None, :] if L > 1 else positions[:, None]  # [B, L]
    attention = paged_attention(table, at, args.attention_scale, bits, group_size)
    return run_blocks(decoder, params, x, positions, pool, attention, args)


def run_prefill_paged(
    decoder: Decoder,
    params: Params,
    tokens: mx.array,
    offsets: mx.array,
    lengths: mx.array,
    table: mx.array,
    pool: PagedKV,
    args,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, PagedKV]:
    """:func:`prefill_paged` for ``decoder``'s family."""
    T = tokens.shape[1]
    x = decoder.embed(params, tokens, args)  # [B, T, H]
    at = offsets[:, None] + mx.arange(T, dtype=mx.int32)[None, :]  # [B, T]
    attention = paged_attention(table, at, args.attention_scale, bits, group_size, ends=offsets + lengths)
    x, pool = run_blocks(decoder, params, x, offsets, pool, attention, args)
    last = mx.take_along_axis(x, (lengths - 1).astype(mx.int32)[:, None, None], axis=1)  # [B, 1, H]
    return decoder.logits(params, last[:, 0, :], args), pool


def run_decode_paged(
    decoder: Decoder,
    params: Params,
    tokens: mx.array,
    positions: mx.array,
    table: mx.array,
    pool: PagedKV,
    args,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, PagedKV]:
    """:func:`decode_paged` for ``decoder``'s family."""
    x, pool = run_paged(decoder, params, tokens[:, None], positions, table, pool, args, bits, group_size)
    return decoder.logits(params, x[:, 0, :], args), pool


def run_verify_paged(
    decoder: Decoder,
    params: Params,
    tokens: mx.array,
    positions: mx.array,
    table: mx.array,
    pool: PagedKV,
    args,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, PagedKV]:
    """:func:`verify_paged` for ``decoder``'s family. The paged view is linear (index j is
    position j), so sliding-window layers verify too: their window is a mask there, not a ring."""
    x, pool = run_paged(decoder, params, tokens, positions, table, pool, args, bits, group_size)
    B, L, H = x.shape
    return decoder.logits(params, x.reshape(B * L, H), args).reshape(B, L, -1), pool


def run_verify(
    decoder: Decoder, params: Params, tokens: mx.array, positions: mx.array, cache: KVCache, args
) -> tuple[mx.array, KVCache]:
    """:func:`verify` for ``decoder``'s family: a chunk at each row's position that returns
    every position's logits [B, L, V]. Its cache layouts must be linear (a ring layer would be
    written past its size: :class:`models.attention.CacheAttention` writes several tokens per
    row linearly), so families with sliding-window rings export no ``verify``."""
    L = tokens.shape[1]
    x = decoder.embed(params, tokens, args)  # [B, L, H]
    at = positions[:, None] + mx.arange(L)[None, :]  # [B, L]
    x, cache = run_blocks(decoder, params, x, positions, cache, CacheAttention(at, args.attention_scale), args)
    B, _, H = x.shape
    return decoder.logits(params, x.reshape(B * L, H), args).reshape(B, L, -1), cache


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
        cache: a linear KV cache [B, Hkv, C, D] per layer, with offsets[b] + T <= C for every row.
        args: hyper-parameters (static).

    Returns:
        (logits float32 [B, V] at each row's last real token of the chunk, the cache with the
        chunk's keys and values written at offsets[b]..offsets[b]+T-1). Positions written for
        padding (>= offsets + lengths) are garbage that decode masks and later overwrites.
    """
    return run_chunk(LLAMA, params, tokens, offsets, lengths, cache, args)


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
    return run_prefill(LLAMA, params, tokens, lengths, cache, args)


def decode(
    params: Params, tokens: mx.array, positions: mx.array, cache: KVCache, *, args: ModelArgs
) -> tuple[mx.array, KVCache]:
    """One decode step for every row of the batch.

    Args:
        params: the model's parameter tree.
        tokens: int32 [B], each row's newest token.
        positions: int32 [B], the position of that token (= tokens already in the cache).
            Must be < C. Empty slots pass 0 and a dummy token; their result is ignored.
        cache: KV cache [B, Hkv, C, D] per layer; a sliding layer may hold a ring of
            min(W, C) positions instead (:mod:`models.attention`).
        args: hyper-parameters (static).

    Returns:
        (logits float32 [B, V], the cache with each row's key/value written at its position).
        Row b attends to cache positions 0..positions[b] only (its last W in a sliding
        layer), so padding rows, stale entries and other rows never influence it.
    """
    return run_decode(LLAMA, params, tokens, positions, cache, args)


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
    return run_verify(LLAMA, params, tokens, positions, cache, args)


def decode_paged(
    params: Params,
    tokens: mx.array,
    positions: mx.array,
    table: mx.array,
    pool: PagedKV,
    *,
    args: ModelArgs,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, PagedKV]:
    """:func:`decode` over a paged KV pool (:mod:`models.paged`): row b's key and value go to
    offset ``positions[b] % bt`` of block ``table[b, positions[b] // bt]``, and it attends over
    its blocks in table order (a view of M * bt positions), masked to 0..positions[b] (its last
    W on a sliding layer).

    Args:
        params: the model's parameter tree.
        tokens: int32 [B], each row's newest token.
        positions: int32 [B], its position; below M * bt. Empty slots pass 0 and a table row of
            null blocks.
        table: int32 [B, M], each row's blocks in position order (null-block padded).
        pool: per layer, keys and values [N, Hkv, bt, D] (with ``bits``: quantized triples).
        args: hyper-parameters (static).
        bits, group_size: quantized KV (``kv_bits``): the pools hold keys and values quantized
            per ``group_size`` values of D (affine, ``mx.quantize``), as mlx-lm's
            ``QuantizedKVCache``, and attention reads them quantized
            (:class:`models.paged.QuantizedPagedAttention`). None: full precision.

    Returns:
        (logits float32 [B, V], the pools with each row's key and value written).
    """
    return run_decode_paged(LLAMA, params, tokens, positions, table, pool, args, bits, group_size)


def verify_paged(
    params: Params,
    tokens: mx.array,
    positions: mx.array,
    table: mx.array,
    pool: PagedKV,
    *,
    args: ModelArgs,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, PagedKV]:
    """:func:`verify` over a paged KV pool (:mod:`models.paged`): row b's W tokens go to
    positions ``positions[b]``..``positions[b] + W - 1`` of its blocks (position p at offset
    ``p % bt`` of block ``table[b, p // bt]``), and query j attends over the row's blocks in
    table order masked to 0..positions[b] + j (its last W on a sliding layer).

    Args:
        params: the model's parameter tree.
        tokens: int32 [B, W]: each row's newest token, then up to W - 1 proposals, padded.
        positions: int32 [B], the position of each row's newest token; positions[b] + W - 1
            must be below M * bt for every row, empty slots included (they pass 0 and a table
            row of null blocks). A position past the row's own blocks must map to a null-block
            column: its write lands in the null block, which attention never reads unmasked.
        table: int32 [B, M], each row's blocks in position order (null-block padded).
        pool: per layer, keys and values [N, Hkv, bt, D] (with ``bits``: quantized triples).
        args: hyper-parameters (static).
        bits, group_size: quantized KV, as :func:`decode_paged`.

    Returns:
        (logits float32 [B, W, V]: entry j scores the token after tokens[b, j]; the pools with
        tokens[b, j]'s key and value written at positions[b] + j). A rejected proposal's key
        and value stay in the row's block past its new position, masked until a later step
        overwrites them (as :func:`verify` leaves them in a static cache). Every block a row's
        positions[b]..positions[b] + W - 1 fall in is written: none of them may be shared with
        another row or published (the caller's copy-on-write).
    """
    return run_verify_paged(LLAMA, params, tokens, positions, table, pool, args, bits, group_size)


def prefill_paged(
    params: Params,
    tokens: mx.array,
    offsets: mx.array,
    lengths: mx.array,
    table: mx.array,
    pool: PagedKV,
    *,
    args: ModelArgs,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, PagedKV]:
    """:func:`prefill_chunk` straight into a paged KV pool (:mod:`models.paged`): no staging
    cache. A whole prompt is a chunk at offset 0; a prefix hit's remainder or a long prompt's
    next chunk starts at its offset, its earlier positions already in its blocks.

    Per layer, row b's chunk keys and values are written at positions offsets[b]..
    offsets[b] + lengths[b] - 1 of its blocks (position p at offset ``p % bt`` of block
    ``table[b, p // bt]``), then its queries attend over the row's blocks gathered in table
    order (a transient view of M * bt positions, one layer at a time), query t seeing positions
    0..offsets[b] + t (its last W on a sliding layer): its earlier positions and the chunk
    itself, causally.

    Args:
        params: the model's parameter tree.
        tokens: int32 [B, T], each row's next prompt tokens, right-padded to the chunk bucket T.
        offsets: int32 [B], where each row's chunk starts (positions already in its blocks).
        lengths: int32 [B], real tokens in each row's chunk (1 <= lengths <= T); padded rows
            pass 1 and a table row of null blocks.
        table: int32 [B, M], each row's blocks in position order (null-block padded);
            offsets[b] + lengths[b] <= M * bt. Every block its real positions fall in must be
            the row's own (unshared, unpublished): the caller's.
        pool: per layer, keys and values [N, Hkv, bt, D] (with ``bits``: quantized triples).
        args: hyper-parameters (static).
        bits, group_size: quantized KV, as :func:`decode_paged`: the chunk's keys and values
            are quantized as they are written, and its queries attend over them quantized
            (mlx-lm's ``QuantizedKVCache`` does the same for a prompt).

    Returns:
        (logits float32 [B, V] at each row's last real token of the chunk, the pools with the
        chunk's real tokens written). Padding tokens (at offsets + lengths and past) are written
        into the null block only, so no block a row or the prefix cache holds changes but the
        ones the rows' real tokens name.
    """
    return run_prefill_paged(LLAMA, params, tokens, offsets, lengths, table, pool, args, bits, group_size)


def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """Drop checkpoint tensors the step functions do not use: precomputed RoPE frequencies,
    and ``lm_head`` when the embeddings are tied (mlx-lm's llama.sanitize does the same)."""
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    if args.tie_word_embeddings:
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    return weights


__all__ = [
    "ModelArgs",
    "decode",
    "decode_paged",
    "verify",
    "verify_paged",
    "fuse_projections",
    "prefill",
    "prefill_chunk",
    "prefill_paged",
    "sanitize",
]
