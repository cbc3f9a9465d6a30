"""BERT as a sentence encoder: a pure forward over a parameter tree, for embedding models.

The checkpoint is Hugging Face transformers' ``BertModel`` layout (``config.json`` with
``model_type: "bert"``, ``model.safetensors`` with ``embeddings.*``, ``encoder.layer.{i}.*``
and ``pooler.*``), as sentence-transformers' models such as all-MiniLM-L6-v2 ship it. The
layer follows transformers' ``modeling_bert.py``: post-LayerNorm residual blocks, absolute
learned positions, token-type embeddings, exact (erf) GELU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

Params = dict[str, Any]
ATTENTION_SCORE_BYTES = 4  # attention scores counted as float32: a bound for any compute dtype


@dataclass(frozen=True)
class BertArgs:
    """Hyper-parameters read from ``config.json`` (unknown keys ignored)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    model_type: str = "bert"

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> BertArgs:
        """The args of a ``config.json`` dict; keys this class does not name are ignored.

        Raises:
            ValueError: the activation is not ``gelu`` (the only one implemented).
        """
        names = cls.__dataclass_fields__
        args = cls(**{k: v for k, v in config.items() if k in names})
        if args.hidden_act != "gelu":
            raise ValueError(f"hidden_act '{args.hidden_act}' is not implemented for BERT encoders; only 'gelu'")
        return args

    def step_bytes(self, batch: int, length: int, itemsize: int) -> int:
        """Bytes of the activations one encoder call on a padded [``batch``, ``length``] batch may
        hold at once, beside the weights, for :func:`encode` then a pooling (a bound, not a
        measurement; ``itemsize``: the compute dtype's size in bytes).

        Every intermediate of one layer is counted live together, per position: 14 H-wide tensors
        (queries, keys and values and their per-head copies, the context and its copy, the
        projections, residual sums and norms of both blocks) and 4 I-wide ones (the feed-forward's
        input to GELU and GELU's temporaries), at ``itemsize`` but at least 4 bytes an element (on
        the CPU a float16 call peaked at 0.55 to 0.65 of the float32 one, not half), plus the
        attention scores and their softmax, ``batch`` x heads x ``length`` x ``length`` float32
        each (MLX's fallback attention materializes them; :data:`ATTENTION_SCORE_BYTES`), plus the
        float32 copy the pooling reads (``batch`` x ``length`` x H). Layers run one after
        another, so the count does not grow with the number of layers. Measured on
        all-MiniLM-L6-v2 on the CPU (tests/unit/test_embedding_memory.py), the compiled call's
        peak stays below it."""
        h, i = self.hidden_size, self.intermediate_size
        positions = batch * length
        layer = positions * (14 * h + 4 * i) * max(itemsize, 4)
        scores = 2 * batch * self.num_attention_heads * length * length * ATTENTION_SCORE_BYTES
        return layer + scores + positions * h * 4


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Drop what the encoder does not use: ``embeddings.position_ids`` (a buffer) and the
    ``pooler.*`` head (sentence-transformers pools the last hidden state itself); strip a
    ``bert.`` prefix that some checkpoints carry."""
    out = {}
    for key, value in weights.items():
        key = key.removeprefix("bert.")
        if key == "embeddings.position_ids" or key.startswith("pooler."):
            continue
        out[key] = value
    return out


def _linear(p: Params, x: mx.array) -> mx.array:
    return mx.addmm(p["bias"], x, p["weight"].T)


def _norm(p: Params, x: mx.array, eps: float) -> mx.array:
    return mx.fast.layer_norm(x, p["weight"], p["bias"], eps)


def _layer(args: BertArgs, p: Params, x: mx.array, mask: mx.array) -> mx.array:
    """One encoder layer. x: [B, T, H]; mask: [B, 1, 1, T] bool (True: attend)."""
    b, t, _ = x.shape
    heads = args.num_attention_heads
    head_dim = args.hidden_size // heads
    att = p["attention"]

    def split(name: str) -> mx.array:  # [B, heads, T, head_dim]
        return _linear(att["self"][name], x).reshape(b, t, heads, head_dim).transpose(0, 2, 1, 3)

    q, k, v = split("query"), split("key"), split("value")
    ctx = mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(head_dim), mask=mask)
    ctx = ctx.transpose(0, 2, 1, 3).reshape(b, t, args.hidden_size)
    x = _norm(att["output"]["LayerNorm"], _linear(att["output"]["dense"], ctx) + x, args.layer_norm_eps)
    h = nn.gelu(_linear(p["intermediate"]["dense"], x))
    return _norm(p["output"]["LayerNorm"], _linear(p["output"]["dense"], h) + x, args.layer_norm_eps)


def encode(args: BertArgs, params: Params, ids: mx.array, mask: mx.array) -> mx.array:
    """The last hidden state.

    Args:
        ids: [B, T] int32 token ids (padding anywhere ``mask`` is 0).
        mask: [B, T] int32 or bool, 1 for a real token; each row needs at least one.

    Returns:
        [B, T, H] in the parameters' dtype; rows at padded positions are meaningless.
    """
    emb = params["embeddings"]
    positions = mx.arange(ids.shape[1])
    x = emb["word_embeddings"]["weight"][ids] + emb["position_embeddings"]["weight"][positions]
    x = x + emb["token_type_embeddings"]["weight"][0]  # one segment: token type 0 everywhere
    x = _norm(emb["LayerNorm"], x, args.layer_norm_eps)
    attend = (mask != 0)[:, None, None, :]
    for layer in params["encoder"]["layer"]:
        x = _layer(args, layer, x, attend)
    return x


def mean_pool(hidden: mx.array, mask: mx.array) -> mx.array:
    """Mean over real tokens, as sentence-transformers' ``Pooling(pooling_mode_mean_tokens)``.

    hidden: [B, T, H]; mask: [B, T] (1 real, 0 padding). Returns [B, H] float32.
    """
    m = mask.astype(mx.float32)[..., None]
    return (hidden.astype(mx.float32) * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1e-9)


def cls_pool(hidden: mx.array, mask: mx.array) -> mx.array:
    """The first token's state (``pooling_mode_cls_token``). Returns [B, H] float32."""
    return hidden[:, 0].astype(mx.float32)


def l2_normalize(x: mx.array) -> mx.array:
    """Rows scaled to unit L2 norm, as ``torch.nn.functional.normalize`` (eps 1e-12). x: [B, H]."""
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
