"""What a model's configuration may ask for: every key that would change the computation
in a way stepserve does not implement is found here, so that the model is refused at load
rather than served wrong.

mlx-lm's ``ModelArgs.from_dict`` ignores keys it does not know; a key that changes the math,
ignored, gives a model that loads and generates plausible but wrong text (a Llama 3.1
``rope_scaling`` of type ``llama3`` runs with the wrong RoPE frequencies). The keys checked
come from mlx-lm's models/{llama,qwen2,qwen3,rope_utils}.py and the Hugging Face
transformers Llama/Mistral/Qwen2/Qwen3 configurations (``config.json``), and from
llama.cpp's metadata names (src/llama-arch.cpp ``LLM_KV_*``) and converter
(convert_hf_to_gguf.py) for GGUF files.

Implemented, so not refused: ``rope_theta``, ``rope_traditional``, ``head_dim``,
``tie_word_embeddings``, and ``attention_bias``/``mlp_bias`` (:func:`models.layers.linear`
adds any ``bias`` the checkpoint carries; the loader checks that the biases are there).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

#: ``hidden_act`` / ``hidden_activation`` names of SiLU, the activation of the SwiGLU MLP
#: (transformers' ``ACT2FN`` maps both to ``nn.SiLU``).
SILU_NAMES = ("silu", "swish")

#: GGUF keys (after ``{arch}.``) that change the math unless absent or at the value listed,
#: the one that turns them off (llama.cpp's defaults: 0 means "none" or, for
#: ``attention.scale``, 1/sqrt(head dim)).
GGUF_OFF_VALUES: dict[str, float] = {
    "attention.sliding_window": 0,
    "attention.scale": 0,
    "attention.clamp_kqv": 0,
    "attention.max_alibi_bias": 0,
    "attn_logit_softcapping": 0,
    "final_logit_softcapping": 0,
    "expert_count": 0,
    "logit_scale": 1,
    "embedding_scale": 1,
    "residual_scale": 1,
}


def _refusal(key: str, value: Any, supported: str) -> str:
    return f"{key}={json.dumps(value)} is not implemented (supported: {supported})"


def _is_default_rope(value: Any) -> bool:
    """``rope_scaling`` / ``rope_parameters`` that leave RoPE as plain RoPE over the whole
    head: null, ``{}`` or a dict of ``rope_type`` (or ``type``) ``default`` (mlx-lm's
    rope_utils.initialize_rope reads the type the same way)."""
    if value is None:
        return True
    if not isinstance(value, dict):
        return False
    rope_type = value.get("rope_type") or value.get("type") or "default"
    return rope_type == "default" and value.get("partial_rotary_factor", 1) in (1, None)


def _sliding_layers(config: dict[str, Any]) -> int:
    """How many layers would use sliding-window attention under transformers' rules.

    ``layer_types`` names each layer's kind when present. Otherwise a ``sliding_window``
    applies to every layer (Mistral), unless the config carries ``use_sliding_window``
    (Qwen2/Qwen3): then only when that is true, and from layer ``max_window_layers`` on.
    """
    layers = int(config.get("num_hidden_layers") or 0)
    if config.get("layer_types") is not None:
        return sum(t == "sliding_attention" for t in config["layer_types"])
    if config.get("sliding_window") is None or config.get("use_sliding_window") is False:
        return 0
    first = int(config.get("max_window_layers") or 0) if "use_sliding_window" in config else 0
    return max(layers - first, 0)


def unimplemented_config(config: dict[str, Any]) -> list[str]:
    """The keys of a ``config.json`` dict whose values stepserve's Llama family (llama,
    mistral, qwen2, qwen3) does not implement.

    Returns:
        One message per such key, naming the key, its value (as JSON) and what is
        supported; empty when everything the config asks for is implemented.
    """
    found = []
    for key in ("rope_scaling", "rope_parameters"):
        if not _is_default_rope(config.get(key)):
            supported = 'null or {"rope_type": "default"}, RoPE over the whole head'
            found.append(_refusal(key, config[key], supported))
    for key in ("hidden_act", "hidden_activation"):
        if config.get(key) not in (None, *SILU_NAMES):
            found.append(_refusal(key, config[key], " or ".join(f'"{n}"' for n in SILU_NAMES)))
    if config.get("partial_rotary_factor") not in (None, 1):
        found.append(_refusal("partial_rotary_factor", config["partial_rotary_factor"], "1 (RoPE over the whole head)"))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            found.append(_refusal(key, config[key], "null"))
    types = config.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        found.append(_refusal("layer_types", types, '"full_attention" for every layer'))
    elif _sliding_layers(config):
        window = config["sliding_window"]
        if "use_sliding_window" in config:  # Qwen2/Qwen3: on, from layer max_window_layers on
            first = config.get("max_window_layers")
            note = f"layers from max_window_layers={first} on would attend within sliding_window={window}"
            found.append(_refusal("use_sliding_window", True, f"false; {note}"))
        else:  # Mistral: every layer
            found.append(_refusal("sliding_window", window, "null; every layer attends to the whole context"))
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and "quant_method" in quant:  # GPTQ, AWQ, FP8, bitsandbytes, ...
        found.append(_refusal("quantization_config", quant, 'MLX affine quantization (mlx-lm\'s "quantization")'))
    return found


def unimplemented_gguf(metadata: dict[str, Any], tensor_names: Iterable[str], arch: str, head_dim: int) -> list[str]:
    """The GGUF metadata and tensors of an ``arch`` file that stepserve does not implement.

    Args:
        metadata: GGUF metadata with scalars as Python values.
        tensor_names: the file's tensor names.
        arch: ``general.architecture``; keys are read under ``{arch}.``.
        head_dim: the attention head dim (``{arch}.attention.key_length``).

    Returns:
        One message per such key or tensor, as :func:`unimplemented_config` does.
    """
    found = []

    def get(key: str) -> Any:
        return metadata.get(f"{arch}.{key}")

    # llama.cpp reads the type (default "linear") and the factor (rope.scaling.factor, else
    # rope.scale_linear; 0 means none); type "none" turns scaling off whatever the factor.
    rope_type = get("rope.scaling.type")
    factor_key = "rope.scaling.factor" if get("rope.scaling.factor") else "rope.scale_linear"
    if rope_type not in (None, "none", "linear"):
        found.append(_refusal(f"{arch}.rope.scaling.type", rope_type, '"none"'))
    elif rope_type != "none" and get(factor_key) not in (None, 0, 1):
        found.append(_refusal(f"{arch}.{factor_key}", get(factor_key), '1, or rope.scaling.type "none"'))
    for key, off in GGUF_OFF_VALUES.items():
        if get(key) not in (None, off):
            found.append(_refusal(f"{arch}.{key}", get(key), f"absent or {off}"))
    for key in ("rope.dimension_count", "attention.value_length"):
        if get(key) not in (None, head_dim):
            found.append(_refusal(f"{arch}.{key}", get(key), f"the head dim, {head_dim}"))
    for name in tensor_names:
        if name.startswith("rope_freqs") or ".rope_freqs" in name:  # Llama 3.1 "llama3" RoPE
            found.append(f"tensor {name} (RoPE frequency factors) is not implemented (supported: plain RoPE)")
    return found
