"""The two MLX-specific building blocks every architecture uses: a linear layer and an
embedding lookup, each for dense weights or MLX affine-quantized ones, and the one place
that reads a quantized weight's bit width from its shapes.

Parameters are plain nested dicts of arrays (:data:`Params`), as in mlx-lm's checkpoints:
a dense layer is ``{"weight": [out, in]}`` (optionally ``"bias": [out]``), a quantized one
``{"weight", "scales", "biases"}`` (the MLX affine triple, see :func:`quantized_bits`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

#: A parameter tree: nested dicts (and lists of layers) whose leaves are ``mx.array``.
Params = dict[str, Any]

#: Bit widths of MLX's affine quantization (``mx.quantize``).
AFFINE_BITS = (1, 2, 3, 4, 5, 6, 8)


def quantized_bits(p: Params, group_size: int) -> int:
    """Bits per weight of an MLX affine-quantized triple, from its shapes.

    MLX's affine quantization (``mx.quantize``) packs a [out, in] matrix at ``bits`` bits
    into ``weight`` uint32 [out, in * bits / 32] (every width, 3/5/6 included, fills whole
    32-bit words per row) with one scale and one bias per ``group_size`` inputs: ``scales``
    and ``biases`` [out, in / group_size]. Hence::

        bits = 32 * weight.shape[-1] / (scales.shape[-1] * group_size)

    Raises:
        ValueError: the shapes give no MLX bit width at this group size (the group size
            is wrong for these tensors).
    """
    words, groups = p["weight"].shape[-1], p["scales"].shape[-1]
    bits, rest = divmod(32 * words, groups * group_size)
    if rest or bits not in AFFINE_BITS:
        raise ValueError(
            f"a quantized weight of {words} words and {groups} groups per row fits no MLX bit width "
            f"{AFFINE_BITS} at group size {group_size}"
        )
    return bits


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
            bits=quantized_bits(p, group_size),
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
        bits=quantized_bits(p, group_size),
    )
