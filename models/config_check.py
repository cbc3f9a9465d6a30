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
from dataclasses import dataclass
from typing import Any

from models.rope import rope_problems

#: ``hidden_act`` / ``hidden_activation`` names of SiLU, the activation of the SwiGLU MLP
#: (transformers' ``ACT2FN`` maps both to ``nn.SiLU``).
SILU_NAMES = ("silu", "swish")

#: The attention kinds of transformers' ``layer_types``.
LAYER_TYPES = ("full_attention", "sliding_attention")

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


@dataclass(frozen=True)
class Supports:
    """What one architecture implements of the keys :func:`unimplemented_config` checks.

    Attributes:
        activations: the accepted ``hidden_act`` / ``hidden_activation`` values.
        sliding_layer_types: ``layer_types`` may name ``sliding_attention`` layers (with a
            ``sliding_window``); otherwise every layer must be ``full_attention``.
        biases: ``attention_bias`` / ``mlp_bias`` may be true (the loader checks the tensors).
        rope_by_layer_type: ``rope_parameters`` may be nested by layer type (transformers
            >= 5's Gemma 3 form, ``{"full_attention": {...}, "sliding_attention": {...}}``).
        false_keys: keys that must be absent, null or false (e.g. Gemma's
            ``use_bidirectional_attention``).
    """

    activations: tuple[str, ...] = SILU_NAMES
    sliding_layer_types: bool = False
    biases: bool = True
    rope_by_layer_type: bool = False
    false_keys: tuple[str, ...] = ()


def _refusal(key: str, value: Any, supported: str) -> str:
    return f"{key}={json.dumps(value)} is not implemented (supported: {supported})"


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


def _rope_config(config: dict[str, Any], supports: Supports) -> list[str]:
    """``rope_scaling`` and ``rope_parameters`` (flat, or nested by layer type where the
    architecture reads it so) checked by :func:`models.rope.rope_problems`."""
    found = []
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        nested = isinstance(value, dict) and bool(value) and all(isinstance(v, dict) for v in value.values())
        if isinstance(value, dict) and nested and supports.rope_by_layer_type:
            for kind, sub in value.items():
                if kind not in LAYER_TYPES:
                    found.append(_refusal(f"{key}.{kind}", sub, f"layer types {', '.join(LAYER_TYPES)}"))
                found += rope_problems(f"{key}.{kind}", sub)
        else:
            found += rope_problems(key, value)
    return found


def _layers_config(config: dict[str, Any], supports: Supports) -> list[str]:
    """``layer_types``, ``sliding_window`` / ``use_sliding_window`` against what the
    architecture implements."""
    types = config.get("layer_types")
    allowed = LAYER_TYPES if supports.sliding_layer_types else ("full_attention",)
    if types is not None:
        if any(t not in allowed for t in types) or len(types) != config.get("num_hidden_layers", len(types)):
            what = " or ".join(f'"{t}"' for t in allowed)
            return [_refusal("layer_types", types, f"{what} for each of the num_hidden_layers layers")]
        if "sliding_attention" in types and not isinstance(config.get("sliding_window"), int):
            return [_refusal("sliding_window", config.get("sliding_window"), "a window in positions")]
        if "full_attention" not in types:
            return [_refusal("layer_types", types, 'at least one "full_attention" layer')]
        return []
    if not _sliding_layers(config):
        return []
    window = config["sliding_window"]
    if "use_sliding_window" in config:  # Qwen2/Qwen3: on, from layer max_window_layers on
        first = config.get("max_window_layers")
        note = f"layers from max_window_layers={first} on would attend within sliding_window={window}"
        return [_refusal("use_sliding_window", True, f"false; {note}")]
    return [_refusal("sliding_window", window, "null; every layer attends to the whole context")]  # Mistral v0.1


def unimplemented_config(config: dict[str, Any], supports: Supports | None = None) -> list[str]:
    """The keys of a ``config.json`` dict whose values an architecture implementing
    ``supports`` (default: the Llama family's, llama/mistral/qwen2/qwen3) does not implement.

    Returns:
        One message per such key, naming the key, its value (as JSON) and what is
        supported; empty when everything the config asks for is implemented.
    """
    supports = supports or Supports()
    found = _rope_config(config, supports)
    for key in ("hidden_act", "hidden_activation"):
        if config.get(key) not in (None, *supports.activations):
            found.append(_refusal(key, config[key], " or ".join(f'"{n}"' for n in supports.activations)))
    if config.get("partial_rotary_factor") not in (None, 1):
        found.append(_refusal("partial_rotary_factor", config["partial_rotary_factor"], "1 (RoPE over the whole head)"))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            found.append(_refusal(key, config[key], "null"))
    found += _layers_config(config, supports)
    for key in ("attention_bias", "mlp_bias") if not supports.biases else ():
        if config.get(key):
            found.append(_refusal(key, config[key], "false"))
    for key in supports.false_keys:
        if config.get(key):
            found.append(_refusal(key, config[key], "false"))
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and "quant_method" in quant:  # GPTQ, AWQ, FP8, bitsandbytes, ...
        found.append(_refusal("quantization_config", quant, 'MLX affine quantization (mlx-lm\'s "quantization")'))
    return found


def unimplemented_gguf(
    metadata: dict[str, Any], tensor_names: Iterable[str], arch: str, head_dim: int, implemented: Iterable[str] = ()
) -> list[str]:
    """The GGUF metadata and tensors of an ``arch`` file that stepserve does not implement.

    Args:
        metadata: GGUF metadata with scalars as Python values.
        tensor_names: the file's tensor names.
        arch: ``general.architecture``; keys are read under ``{arch}.``.
        head_dim: the attention head dim (``{arch}.attention.key_length``).
        implemented: keys (after ``{arch}.``) of :data:`GGUF_OFF_VALUES` the architecture
            implements (Gemma 3: ``attention.sliding_window``); ``rope.scaling`` of type
            linear is implemented for Gemma 3 (its global layers), refused elsewhere.

    Returns:
        One message per such key or tensor, as :func:`unimplemented_config` does.
    """
    found = []
    implemented = set(implemented)

    def get(key: str) -> Any:
        return metadata.get(f"{arch}.{key}")

    if arch == "gemma3":
        implemented.add("rope.scaling.factor")
    # llama.cpp reads the type (default "linear") and the factor (rope.scaling.factor, else
    # rope.scale_linear; 0 means none); type "none" turns scaling off whatever the factor.
    rope_type = get("rope.scaling.type")
    factor_key = "rope.scaling.factor" if get("rope.scaling.factor") else "rope.scale_linear"
    if rope_type not in (None, "none", "linear"):
        found.append(_refusal(f"{arch}.rope.scaling.type", rope_type, '"none"'))
    elif rope_type != "none" and get(factor_key) not in (None, 0, 1) and factor_key not in implemented:
        found.append(_refusal(f"{arch}.{factor_key}", get(factor_key), '1, or rope.scaling.type "none"'))
    for key, off in GGUF_OFF_VALUES.items():
        if get(key) not in (None, off) and key not in implemented:
            found.append(_refusal(f"{arch}.{key}", get(key), f"absent or {off}"))
    for key in ("rope.dimension_count", "attention.value_length"):
        if get(key) not in (None, head_dim):
            found.append(_refusal(f"{arch}.{key}", get(key), f"the head dim, {head_dim}"))
    for name in tensor_names:
        if name.startswith("rope_freqs") or ".rope_freqs" in name:  # Llama 3.1 "llama3" RoPE
            found.append(f"tensor {name} (RoPE frequency factors) is not implemented (supported: plain RoPE)")
    return found
