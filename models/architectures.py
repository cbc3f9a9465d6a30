"""The architectures stepserve implements, by the checkpoint's ``model_type`` (mlx-lm's
convention: one module per type, each exporting ``ModelArgs``, ``prefill``,
``prefill_chunk``, ``decode`` and ``sanitize``, and ``verify`` (speculative decoding) where its
decode cache has no sliding-window rings)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from models import gemma3_text, llama, qwen2, qwen3, qwen3_moe

#: model_type -> the module that implements it.
ARCHITECTURES: dict[str, ModuleType] = {
    "llama": llama,
    "mistral": llama,
    "smollm": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma3_text": gemma3_text,
    "qwen3_moe": qwen3_moe,
}


class UnsupportedArchitectureError(ValueError):
    """A ``model_type`` stepserve does not implement; the message lists those it does."""


def architecture(model_type: str | None, path: Path | str = "config.json") -> ModuleType:
    """The module implementing ``model_type``.

    Raises:
        UnsupportedArchitectureError: naming ``path``, the type and the supported ones.
    """
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: model_type '{model_type}' is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type]
