"""Qwen3 (``model_type: qwen3``): the Llama step functions with per-head RMSNorm of queries
and keys before RoPE (``self_attn.q_norm``/``k_norm``), applied by
:func:`models.llama.project_qkv` when present; ``head_dim`` comes from the config.
Sliding-window layers are refused (mlx-lm's qwen3 ignores them)."""

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
from models.qwen2 import ModelArgs

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
