"""Qwen2 (``model_type: qwen2``): the Llama step functions with biases on the Q/K/V
projections, which the checkpoint carries as ``*.bias`` and :func:`models.llama.linear`
adds when present."""

from models.llama import ModelArgs, decode, prefill, prefill_chunk, sanitize, verify

__all__ = ["ModelArgs", "decode", "prefill", "prefill_chunk", "sanitize", "verify"]
