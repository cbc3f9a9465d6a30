"""Fused projections: one matmul where a layer ran three (Q, K, V) or two (gate, up)."""

from __future__ import annotations

import mlx.core as mx

from models.layers import Params


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
