"""A model named by its Hugging Face repo id (``ORG/NAME``, optionally ``ORG/NAME@REVISION``,
and for a repo of GGUF files ``ORG/NAME:QUANT`` or ``ORG/NAME:FILE.gguf``), resolved in the
Hugging Face cache with ``huggingface_hub``: downloaded when online, found in the cache when
``HF_HUB_OFFLINE=1``. The cache is the hub's own (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``), shared with mlx-lm and transformers, so a model fetched by either
is found here too.

A repo of safetensors resolves to its snapshot directory (only :data:`ALLOW_PATTERNS` files). A
repo of GGUF files (as ``bartowski/…-GGUF`` or ``unsloth/…-GGUF``) resolves to one GGUF file,
downloaded alone: the one the ``:TAG`` names, as llama.cpp's ``-hf ORG/NAME:QUANT`` and Ollama's
``hf.co/ORG/NAME:QUANT`` name it (a quantization such as ``Q4_K_M``, matched case-insensitively
at the end of the file name, or the file's name or path in the repo); without a tag, the repo's
only GGUF file. A repo of several is refused with a list of them and the fix. Online the choice
is among the repo's files; offline among the GGUF files in the cache.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import validate_repo_id

from models.errors import ModelLoadError

#: The files a served model directory needs (mlx-lm's own download patterns): config and
#: tokenizer files, safetensors shards, SentencePiece and tiktoken vocabularies, chat templates.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jsonl", "*.jinja"]

_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")  # llama.cpp's gguf-split parts: NAME-00001-of-00003.gguf
_QUANT = re.compile(r"[-._]((?:UD-)?(?:[IT]?Q\d+(?:_[A-Z0-9]+)*|B?F16|F32|MXFP4))$", re.IGNORECASE)
_COMMIT = re.compile(r"[0-9a-f]{40}")


class RepoRef(NamedTuple):
    """A model named on the Hugging Face Hub.

    Attributes:
        repo: ``ORG/NAME`` (or ``NAME``).
        revision: a branch, tag or commit (None: the default branch).
        tag: the GGUF file to serve from a repo of them: a quantization (``Q4_K_M``) or the
            file's name (``NAME-Q4_K_M.gguf``); None: the repo's model directory, or its only GGUF.
    """

    repo: str
    revision: str | None = None
    tag: str | None = None

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.tag}" if self.tag else "")


def repo_id_of(path: str | Path) -> RepoRef | None:
    """The repo ``path`` names when it names no local file or directory and reads as a Hugging
    Face repo id: ``NAME`` or ``ORG/NAME``, then an optional ``@REVISION``, then an optional
    ``:TAG`` (a GGUF file's quantization or name), the whole optionally after Ollama's ``hf.co/``
    (or ``huggingface.co/``); else None."""
    text = str(path)
    if Path(text).exists() or text.startswith((".", "/", "~")):
        return None
    for prefix in ("hf.co/", "huggingface.co/"):
        text = text.removeprefix(prefix)
    head, colon, tag = text.partition(":")
    repo, _, revision = head.partition("@")
    if repo.count("/") > 1 or (colon and not tag) or "@" in tag or ("/" in tag and not tag.lower().endswith(".gguf")):
        return None
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return RepoRef(repo, revision or None, tag or None)


def resolve_model_path(path: str | Path) -> Path:
    """``path`` itself when it exists or is no repo id (:func:`repo_id_of`); else, in the
    Hugging Face cache (downloaded first unless ``HF_HUB_OFFLINE=1``), the repo's snapshot
    directory (only :data:`ALLOW_PATTERNS` files), or the GGUF file its tag names or that it
    alone holds (:func:`choose_gguf`).

    Raises:
        ModelLoadError: offline and the repo (or the GGUF file) is not in the cache; online and
            the download failed (an unknown or gated repo, no network); a GGUF repo whose file
            is ambiguous or matches nothing, or is split in parts. The message names the repo id,
            the cache or the files, and the fix.
    """
    ref = repo_id_of(path)
    if ref is None:
        return Path(path)
    files = _repo_files(ref)
    if files is None:
        raise _not_cached(ref)
    gguf = choose_gguf(ref, files)
    try:
        if gguf is not None:
            return Path(hf_hub_download(ref.repo, gguf, revision=ref.revision))
        return Path(snapshot_download(ref.repo, revision=ref.revision, allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            raise _not_cached(ref, gguf) from exc
        raise ModelLoadError(
            f"model '{ref}': not a local path, and downloading it from the Hugging Face Hub failed ({exc}); "
            "check the network, or pass the model's directory or file"
        ) from exc
    except Exception as exc:  # unknown or gated repo, revision not found, HTTP errors
        raise ModelLoadError(
            f"model '{ref}': not a local path, and the Hugging Face Hub could not provide it "
            f"({type(exc).__name__}: {exc}); check the repo id and revision (a gated repo needs HF_TOKEN), "
            "or pass the model's directory or file"
        ) from exc


def choose_gguf(ref: RepoRef, files: list[str]) -> str | None:
    """The GGUF file to serve from a repo holding ``files`` (paths in the repo), or None to
    serve the repo as a model directory (no tag, and it holds safetensors or no GGUF file).

    With a tag: the one GGUF file whose path or name is the tag, else whose name (less a
    ``-00001-of-00002`` part suffix) ends with the tag after a ``-``, ``.`` or ``_``, case
    aside (``Q4_0`` matches ``Model-Q4_0.gguf``, not ``Model-IQ4_0.gguf`` nor
    ``Model-Q4_0_4_4.gguf``). Without one: the only GGUF file. Vision projectors
    (``mmproj*.gguf``) are never chosen by quantization.

    Raises:
        ModelLoadError: the tag matches no file or several, the repo holds several GGUF files
            and no tag, or the file is split in parts; the message lists the GGUF files and
            the fix.
    """
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if ref.tag is None:
        if any(f.endswith(".safetensors") for f in files):
            return None
        models = _models(ggufs)
        if not models:
            return None
        if len(models) > 1:
            raise ModelLoadError(
                f"model '{ref}' holds {len(models)} GGUF files; name the one to serve after a ':' as llama.cpp "
                f"(-hf) and Ollama (hf.co/...) do, by quantization or file name: {_choices(ref, models)}"
            )
        return _whole(ref, models[0])
    tag = ref.tag.lower()
    exact = [f for f in ggufs if f.lower() == tag or PurePosixPath(f).name.lower() == tag]
    if exact:
        return _whole(ref, exact[0])
    matches = [m for m in _models(ggufs) if _ends_with_tag(m, tag)]
    if len(matches) == 1:
        return _whole(ref, matches[0])
    if not matches:
        if not ggufs:
            raise ModelLoadError(
                f"model '{ref}': the repo holds no GGUF file{_where()}; a tag after ':' names a GGUF file of a "
                f"GGUF repo; remove ':{ref.tag}' to serve the repo's model directory"
            )
        raise ModelLoadError(
            f"model '{ref}': no GGUF file{_where()} matches '{ref.tag}'; the repo's GGUF files: "
            f"{_choices(ref, _models(ggufs))}"
        )
    raise ModelLoadError(
        f"model '{ref}': {len(matches)} GGUF files match '{ref.tag}'; name one by its file name: "
        f"{_choices(ref, matches, by_name=True)}"
    )


def _ends_with_tag(path: str, tag: str) -> bool:
    """``path``'s name (less a part suffix) ends with ``tag`` (lower case) after a separator."""
    stem = _SPLIT.sub("", PurePosixPath(path).stem).lower()
    return stem.endswith(tag) and len(stem) > len(tag) and stem[-len(tag) - 1] in "-._"


def _models(ggufs: list[str]) -> list[str]:
    """The models among GGUF files: a split model once (its first part), no vision projector."""
    firsts = [f for f in ggufs if (m := _SPLIT.search(PurePosixPath(f).stem)) is None or int(m.group(1)) == 1]
    return sorted(f for f in firsts if not PurePosixPath(f).name.lower().startswith("mmproj"))


def _whole(ref: RepoRef, path: str) -> str:
    """``path``, unless it is a part of a split GGUF (ModelLoadError: not served)."""
    split = _SPLIT.search(PurePosixPath(path).stem)
    if split is not None and int(split.group(2)) > 1:
        raise ModelLoadError(
            f"model '{ref}': {path} is part 1 of a GGUF split in {int(split.group(2))} parts, which stepserve does "
            "not read; merge the parts into one file with llama.cpp's 'llama-gguf-split --merge' and pass that "
            "file, or choose a quantization stored in one file"
        )
    return path


def _choices(ref: RepoRef, models: list[str], by_name: bool = False) -> str:
    """Each GGUF file with the ``--model`` value that names it, then an example for TOML."""
    base = str(RepoRef(ref.repo, ref.revision))

    def name(path: str) -> str:
        quant = None if by_name else _QUANT.search(_SPLIT.sub("", PurePosixPath(path).stem))
        return f"{base}:{quant.group(1) if quant else PurePosixPath(path).name}"

    listed = "; ".join(f"{path} ({name(path)})" for path in models)
    return f'{listed}; e.g. --model {name(models[0])}, or path = "{name(models[0])}" in a [[models]] table'


def _where() -> str:
    return " in the Hugging Face cache (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else ""


def _repo_files(ref: RepoRef) -> list[str] | None:
    """The repo's files (paths in it): the Hub's listing when online (those of its snapshot in
    the cache when the listing fails and the cache holds it), those of its cached snapshot
    offline; None offline when the cache does not hold it.

    Raises:
        ModelLoadError: online, the listing failed (no network, an unknown or gated repo, no
            such revision) and the cache does not hold the repo.
    """
    if constants.HF_HUB_OFFLINE:
        return _cached_files(ref)
    try:
        return HfApi().list_repo_files(ref.repo, revision=ref.revision)
    except Exception as exc:  # no network, gated, unknown: as snapshot_download, fall back on the cache
        cached = _cached_files(ref)
        if cached is None:
            raise ModelLoadError(
                f"model '{ref}': not a local path, and the Hugging Face Hub could not list its files "
                f"({type(exc).__name__}: {exc}); check the repo id, the revision and the network (a gated repo "
                "needs HF_TOKEN), or pass the model's directory or file"
            ) from exc
        return cached


def _cached_files(ref: RepoRef) -> list[str] | None:
    """The files of ``ref``'s snapshot in the Hugging Face cache (``models--ORG--NAME/snapshots/
    COMMIT/``, the commit read from ``refs/REVISION`` unless the revision is one), or None."""
    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=ref.repo, repo_type="model")
    revision = ref.revision or "main"
    commit = revision
    if not _COMMIT.fullmatch(revision):
        ref_file = storage / "refs" / revision
        if not ref_file.is_file():
            return None
        commit = ref_file.read_text().strip()
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _not_cached(ref: RepoRef, gguf: str | None = None) -> ModelLoadError:
    what = f"'{ref}'" if gguf is None else f"'{ref}' ({gguf})"
    fetch = f"'hf download {ref.repo}{' ' + gguf if gguf else ''}'"
    return ModelLoadError(
        f"model {what} is neither a local path nor in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
        f"HF_HUB_OFFLINE=1 forbids downloading it; download it once online (unset HF_HUB_OFFLINE, or run "
        f"{fetch}), point HF_HUB_CACHE or HF_HOME at the cache that holds it, or pass the model's directory or file"
    )
