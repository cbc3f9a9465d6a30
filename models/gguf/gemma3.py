"""Gemma 3 GGUF files (``general.architecture: gemma3``, written by llama.cpp's
convert_hf_to_gguf.py) as a ``gemma3_text`` configuration and parameter names.

The metadata does not say everything: llama.cpp's loader (src/llama-model.cpp, Gemma 3's
hyper-parameters) fixes the local layers' RoPE base at 10,000 unless ``rope.freq_base_swa``
says otherwise, makes every 6th layer global when a sliding window is given, and scales
attention by 1/sqrt(hidden / heads) for the 62-layer 27B model and 1/sqrt(head dim)
otherwise; the same rules are followed here. The converter stores each RMSNorm weight as
1 + w, which is how the step functions take them (:func:`models.gemma3_text.sanitize`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from models import gemma3_text
from models.config_check import unimplemented_gguf
from models.errors import ModelLoadError

MODEL_TYPE = "gemma3_text"
ARCH = "gemma3"
#: llama.cpp's Gemma 3 constants: the local RoPE base, the layer pattern, the 27B's depth.
LOCAL_ROPE_BASE = 10_000.0
PATTERN = 6
LAYERS_27B = 62

#: GGUF layer tensor -> stepserve path (gguf-py's tensor_mapping.py for Gemma 3).
LAYER_NAMES = {
    "attn_norm": ("input_layernorm",),
    "attn_q": ("self_attn", "q_proj"),
    "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"),
    "attn_q_norm": ("self_attn", "q_norm"),
    "attn_k_norm": ("self_attn", "k_norm"),
    "attn_output": ("self_attn", "o_proj"),
    "post_attention_norm": ("post_attention_layernorm",),
    "ffn_norm": ("pre_feedforward_layernorm",),
    "ffn_gate": ("mlp", "gate_proj"),
    "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
    "post_ffw_norm": ("post_feedforward_layernorm",),
}


def config_from_metadata(meta: dict[str, Any], tensors: dict[str, mx.array], path: Path) -> dict[str, Any]:
    """The Hugging Face ``config.json`` (``model_type: gemma3_text``) a Gemma 3 GGUF describes.

    Raises:
        ModelLoadError: a required key is missing, or the file asks for something not
            implemented (:func:`models.config_check.unimplemented_gguf`).
    """

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{ARCH}.{key}", default)

    try:
        heads, hidden, layers = int(get("attention.head_count")), int(get("embedding_length")), int(get("block_count"))
        head_dim = int(get("attention.key_length"))
        window = int(get("attention.sliding_window") or 0)
        config = {
            "model_type": MODEL_TYPE,
            "architectures": ["Gemma3ForCausalLM"],
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "intermediate_size": int(get("feed_forward_length")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
            "vocab_size": int(tensors["token_embd.weight"].shape[0]),
            "rope_theta": float(get("rope.freq_base", 1_000_000.0)),
            "rope_local_base_freq": float(get("rope.freq_base_swa", LOCAL_ROPE_BASE)),
            "query_pre_attn_scalar": hidden // heads if layers == LAYERS_27B else head_dim,
            "max_position_embeddings": int(get("context_length", 32768)),
            "sliding_window": window or None,
            "layer_types": [
                "full_attention" if not window or (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(layers)
            ],
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": "output.weight" not in tensors,
            "rope_scaling": _rope_scaling(get("rope.scaling.type"), get("rope.scaling.factor")),
        }
    except (KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: GGUF metadata lacks a required key ({exc})") from exc
    problems = unimplemented_gguf(meta, tensors, ARCH, head_dim, implemented=("attention.sliding_window",))
    if problems:
        raise ModelLoadError(f"{path}: " + "; ".join(problems))
    return config


def _rope_scaling(kind: str | None, factor: float | None) -> dict[str, Any] | None:
    """llama.cpp's ``rope.scaling`` of a Gemma 3 file (linear, global layers only: Gemma 3
    4B+) as a ``rope_scaling`` dict; None when there is none."""
    if kind == "none" or factor in (None, 0, 1):
        return None
    return {"rope_type": kind or "linear", "factor": float(factor)}  # llama.cpp's default type: linear


def args_from_metadata(meta: dict[str, Any], tensors: dict[str, mx.array], path: Path) -> gemma3_text.ModelArgs:
    """:func:`config_from_metadata` as :class:`models.gemma3_text.ModelArgs` (checked as a
    ``config.json`` is). Raises ModelLoadError naming the file and the problem."""
    config = config_from_metadata(meta, tensors, path)
    try:
        return gemma3_text.ModelArgs.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
