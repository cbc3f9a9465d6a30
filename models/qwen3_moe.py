"""Qwen3-MoE (``model_type: qwen3_moe``; Qwen Team 2025, "Qwen3 Technical Report"): Qwen3's
attention with a mixture-of-experts MLP in every ``decoder_sparse_step``-th layer not listed
in ``mlp_only_layers`` (the others keep a dense SwiGLU MLP of ``intermediate_size``).

Routing, as transformers' ``Qwen3MoeSparseMoeBlock`` and mlx-lm's ``qwen3_moe`` compute it: a
linear router (``mlp.gate``, [E, H]) gives each token a softmax over the E experts; the
``num_experts_per_tok`` (k) most probable are kept, their probabilities renormalized to sum
to 1 when ``norm_topk_prob``; the output is the weighted sum of those k experts' SwiGLU MLPs
(``moe_intermediate_size`` wide).

The experts are stacked (``mlp.switch_mlp.{gate,up,down}_proj``: [E, out, in] dense, or MLX
affine-quantized triples with a leading E axis) and applied with ``mx.gather_mm`` /
``mx.gather_qmm``, which multiply each token by the rows of its own experts only (mlx-lm's
``SwitchGLU``); all shapes are static, so the steps compile once per bucket like the dense
models'. Checkpoints with per-expert tensors (Hugging Face's ``mlp.experts.{e}.*``) are
stacked at load (:func:`sanitize`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx

from models import llama, qwen2
from models.attention import Attend
from models.kv_cache import KVCache
from models.layers import Params, linear, quantized_bits
from models.llama import Decoder, attention_residual, swiglu_mlp
from models.model_args import REQUIRED_KEYS

#: Index count from which tokens are sorted by expert before the gathered matmuls (mlx-lm's
#: SwitchGLU uses the same threshold: contiguous rows per expert pay off for many tokens).
SORT_FROM = 64


@dataclass(frozen=True)
class ModelArgs(qwen2.ModelArgs):
    """Qwen3-MoE's hyper-parameters: Qwen3's plus the experts'."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False

    # transformers defaults norm_topk_prob to false, mlx-lm requires it: a config must say.
    required: ClassVar[tuple[str, ...]] = (
        *REQUIRED_KEYS,
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
    )

    @classmethod
    def _values(cls, config: dict[str, Any]) -> dict[str, Any]:
        values = super()._values(config)
        values["mlp_only_layers"] = tuple(config.get("mlp_only_layers") or ())
        return values

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts (transformers' rule)."""
        return (
            layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
        )


def _gathered(x: mx.array, p: Params, indices: mx.array, g: int, sorted_indices: bool) -> mx.array:
    """x [..., 1, in] times the [out, in] matrix of expert ``indices`` [...] of the stacked
    weight ``p`` ([E, out, in], or its MLX affine triple) -> [..., 1, out]."""
    if "scales" in p:
        return mx.gather_qmm(
            x,
            p["weight"],
            p["scales"],
            p["biases"],
            rhs_indices=indices,
            transpose=True,
            group_size=g,
            bits=quantized_bits(p, g),
            sorted_indices=sorted_indices,
        )
    return mx.gather_mm(x, p["weight"].swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)


def switch_glu(p: Params, x: mx.array, indices: mx.array, g: int) -> mx.array:
    """Each token's SwiGLU through each of its experts.

    x [B, L, H], indices int32 [B, L, k] -> [B, L, k, H]. With k x B x L >= :data:`SORT_FROM`
    the (token, expert) pairs are sorted by expert first and unsorted after (a static choice:
    the shapes are the bucket's).
    """
    B, L, k = indices.shape
    x = mx.expand_dims(x, (-2, -3))  # [B, L, 1, 1, H]
    order = None
    if indices.size >= SORT_FROM:
        flat = indices.flatten()
        order = mx.argsort(flat)
        x, indices = x.flatten(0, -3)[order // k], flat[order]  # [N, 1, H], [N] with N = B L k
    sort = order is not None
    up = _gathered(x, p["up_proj"], indices, g, sort)
    gate = _gathered(x, p["gate_proj"], indices, g, sort)
    y = _gathered(gate * mx.sigmoid(gate) * up, p["down_proj"], indices, g, sort)
    if order is not None:
        y = y[mx.argsort(order)].reshape(B, L, k, 1, -1)
    return y.squeeze(-2)


def moe(p: Params, x: mx.array, args: ModelArgs) -> mx.array:
    """The sparse MLP: x [B, L, H] -> [B, L, H] (routing as the module docstring says)."""
    g, k = args.quant_group_size, args.num_experts_per_tok
    probs = mx.softmax(linear(x, p["gate"], g), axis=-1, precise=True)  # [B, L, E]
    indices = mx.argpartition(probs, kth=-k, axis=-1)[..., -k:]  # [B, L, k], unordered
    scores = mx.take_along_axis(probs, indices, axis=-1)
    if args.norm_topk_prob:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    y = switch_glu(p["switch_mlp"], x, indices, g)  # [B, L, k, H]
    return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)


def _block(
    layer: Params, x: mx.array, offset, keys: mx.array, values: mx.array, attend: Attend, args: ModelArgs, i: int
) -> tuple[mx.array, mx.array, mx.array]:
    """Qwen3's attention, then the sparse or the dense MLP."""
    x, keys, values = attention_residual(layer, x, offset, keys, values, attend, args, i)
    h = mx.fast.rms_norm(x, layer["post_attention_layernorm"]["weight"], args.rms_norm_eps)
    mlp = layer["mlp"]
    out = moe(mlp, h, args) if "switch_mlp" in mlp else swiglu_mlp(mlp, h, args.quant_group_size)
    return x + out, keys, values


QWEN3_MOE = Decoder(llama.embed_tokens, _block, llama.final_logits)


def prefill(params: Params, tokens: mx.array, lengths: mx.array, cache: KVCache, *, args: ModelArgs):
    """:func:`models.llama.prefill` with Qwen3-MoE's blocks (same arguments, shapes and result)."""
    return llama.run_prefill(QWEN3_MOE, params, tokens, lengths, cache, args)


def prefill_chunk(
    params: Params, tokens: mx.array, offsets: mx.array, lengths: mx.array, cache: KVCache, *, args: ModelArgs
):
    """:func:`models.llama.prefill_chunk` with Qwen3-MoE's blocks."""
    return llama.run_chunk(QWEN3_MOE, params, tokens, offsets, lengths, cache, args)


def decode(params: Params, tokens: mx.array, positions: mx.array, cache: KVCache, *, args: ModelArgs):
    """:func:`models.llama.decode` with Qwen3-MoE's blocks."""
    return llama.run_decode(QWEN3_MOE, params, tokens, positions, cache, args)


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
    return llama.run_prefill_paged(QWEN3_MOE, params, tokens, offsets, lengths, table, pool, args, bits, group_size)


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
    return llama.run_decode_paged(QWEN3_MOE, params, tokens, positions, table, pool, args, bits, group_size)


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
    """:func:`models.llama.verify_paged` with this family's blocks."""
    return llama.run_verify_paged(QWEN3_MOE, params, tokens, positions, table, pool, args, bits, group_size)


def verify(params: Params, tokens: mx.array, positions: mx.array, cache: KVCache, *, args: ModelArgs):
    """:func:`models.llama.verify` with Qwen3-MoE's blocks (speculative decoding's verify step)."""
    return llama.run_verify(QWEN3_MOE, params, tokens, positions, cache, args)


_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$"
)


def sanitize(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """:func:`models.llama.sanitize`, with per-expert tensors (Hugging Face's
    ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.{weight,scales,biases}``) stacked
    along a new leading expert axis into ``mlp.switch_mlp.*`` (mlx-community's layout).

    Raises:
        ValueError: a layer's experts are incomplete (not exactly 0..num_experts-1).
    """
    out = llama.sanitize(weights, args)
    groups: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    for key in [k for k in out if ".experts." in k]:
        match = _EXPERT.match(key)
        if match:
            prefix, expert, proj, leaf = match.groups()
            groups.setdefault((prefix, proj, leaf), {})[int(expert)] = out.pop(key)
    for (prefix, proj, leaf), experts in groups.items():
        if sorted(experts) != list(range(args.num_experts)):
            raise ValueError(f"{prefix}.experts has experts {sorted(experts)[:5]}..., not 0..{args.num_experts - 1}")
        out[f"{prefix}.switch_mlp.{proj}.{leaf}"] = mx.stack([experts[e] for e in range(args.num_experts)])
    return out
