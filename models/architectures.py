"""The architectures stepserve implements, by the checkpoint's ``model_type`` (mlx-lm's
convention: one module per type, each exporting ``ModelArgs``, ``prefill``,
``prefill_chunk``, ``decode`` and ``sanitize``, and ``verify`` (speculative decoding) where its
decode cache has no sliding-window rings)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Literal

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


#: Which implementation serves a model: ``auto`` (the hand-written module where one exists for
#: the directory's ``model_type``, else mlx-lm's class), ``native`` or ``mlx_lm``.
ModelImpl = Literal["auto", "native", "mlx_lm"]


def uses_mlx_lm(path: Path, impl: ModelImpl) -> bool:
    """Whether ``path`` is served through mlx-lm's class (see :data:`ModelImpl`). A GGUF file
    is served through it with ``mlx_lm`` only: ``auto`` keeps both GGUF architectures
    stepserve reads (Llama-family, Gemma 3) on their hand-written modules."""
    if impl == "native":
        return False
    if impl == "mlx_lm":
        return True
    if not path.is_dir():
        return False
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False  # the native loader names the problem
    return model_type not in ARCHITECTURES
