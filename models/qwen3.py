"""Qwen3 (``model_type: qwen3``): the Llama step functions with per-head RMSNorm of queries
and keys before RoPE (``self_attn.q_norm``/``k_norm``), applied by
:func:`models.llama._project_qkv` when present; ``head_dim`` comes from the config."""

from models.llama import ModelArgs, decode, prefill, prefill_chunk, sanitize, verify

__all__ = ["ModelArgs", "decode", "prefill", "prefill_chunk", "sanitize", "verify"]
