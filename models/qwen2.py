"""Qwen2 (``model_type: qwen2``): the Llama step functions with biases on the Q/K/V
projections, which the checkpoint carries as ``*.bias`` and :func:`models.layers.linear`
adds when present. Sliding-window layers and the ``attention_bias``/``mlp_bias`` flags are
refused (mlx-lm's qwen2 and qwen3 ignore them, so there is no reference to match)."""

from dataclasses import dataclass
from typing import ClassVar

from models import model_args
from models.config_check import Supports
from models.llama import (
    decode,
    decode_paged,
    prefill,
    prefill_chunk,
    prefill_paged,
    sanitize,
    verify,
    verify_paged,
)


@dataclass(frozen=True)
class ModelArgs(model_args.ModelArgs):
    """:class:`models.model_args.ModelArgs` without sliding-window layers or bias flags."""

    supports: ClassVar[Supports] = Supports(biases=False)


__all__ = [
    "ModelArgs",
    "decode",
    "decode_paged",
    "prefill",
    "prefill_chunk",
    "prefill_paged",
    "sanitize",
    "verify",
    "verify_paged",
]
