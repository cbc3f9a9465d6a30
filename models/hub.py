"""A model named by its Hugging Face repo id (``ORG/NAME``, optionally ``ORG/NAME@REVISION``),
resolved to a directory of the Hugging Face cache with ``huggingface_hub.snapshot_download``:
downloaded when online, found in the cache when ``HF_HUB_OFFLINE=1``. The cache is the hub's own
(``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), shared with mlx-lm and
transformers, so a model fetched by either is found here too."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

from models.errors import ModelLoadError

#: The files a served model directory needs (mlx-lm's own download patterns): config and
#: tokenizer files, safetensors shards, SentencePiece and tiktoken vocabularies, chat templates.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jsonl", "*.jinja"]


def repo_id_of(path: str | Path) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when ``path`` names no local file or directory and reads as a
    Hugging Face repo id (``NAME`` or ``ORG/NAME``, an optional ``@REVISION``); else None."""
    text = str(path)
    if Path(text).exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
        return None
    repo, _, revision = text.partition("@")
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return repo, revision or None


def resolve_model_path(path: str | Path) -> Path:
    """``path`` itself when it exists or is no repo id (:func:`repo_id_of`); else the repo's
    snapshot directory in the Hugging Face cache (only :data:`ALLOW_PATTERNS` files), downloaded
    first unless ``HF_HUB_OFFLINE=1``.

    Raises:
        ModelLoadError: offline and the repo is not in the cache, or online and the download
            failed (an unknown or gated repo, no network); the message names the repo id, the
            cache and the fix.
    """
    named = repo_id_of(path)
    if named is None:
        return Path(path)
    repo, revision = named
    at = f"@{revision}" if revision else ""
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            raise ModelLoadError(
                f"model '{repo}{at}' is neither a local path nor in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 forbids downloading it; download it once "
                f"online (unset HF_HUB_OFFLINE, or run 'hf download {repo}'), point HF_HUB_CACHE or HF_HOME "
                "at the cache that holds it, or pass the model's directory"
            ) from exc
        raise ModelLoadError(
            f"model '{repo}{at}': not a local path, and downloading it from the Hugging Face Hub failed ({exc}); "
            "check the network, or pass the model's directory"
        ) from exc
    except Exception as exc:  # unknown or gated repo, revision not found, HTTP errors
        raise ModelLoadError(
            f"model '{repo}{at}': not a local path, and the Hugging Face Hub could not provide it "
            f"({type(exc).__name__}: {exc}); check the repo id and revision (a gated repo needs HF_TOKEN), "
            "or pass the model's directory"
        ) from exc
