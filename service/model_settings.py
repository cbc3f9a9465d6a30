"""Per-model settings: one ``[[models]]`` table of the TOML file (:class:`ModelSettings`) and a
model to serve with every setting resolved (:class:`ServedModel`, from
:meth:`service.config.Settings.served_models`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from models.embedding_dir import is_embedding_model
from models.hub import RepoRef, repo_id_of


def ascending(values: list[int]) -> list[int]:
    """``values`` when they are a non-empty ascending list of distinct positive integers (a
    bucket ladder). Raises ValueError otherwise."""
    if not values or any(v <= 0 for v in values) or values != sorted(set(values)):
        raise ValueError(f"must be a non-empty ascending list of distinct positive integers, got {values}")
    return values


class ModelSettings(BaseModel):
    """One served model (a ``[[models]]`` table in the TOML file). Unset fields take the
    top-level setting of the same meaning (``path`` <- ``model``, ``name`` <- ``model_name``).
    ``path``: a local GGUF file or model directory, or a Hugging Face repo id (``ORG/NAME``, a
    repo of GGUF files ``ORG/NAME:QUANT``; :func:`models.hub.resolve_model_path`). ``load``:
    ``startup`` (loaded and warmed before ready) or ``on_demand`` (loaded by its first request,
    unloaded after ``ttl_s`` seconds idle; unset: kept once loaded;
    :mod:`service.process.on_demand`)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    path: Path | None = None
    model_impl: Literal["auto", "native", "mlx_lm"] | None = None
    reasoning_parser: Literal["auto", "none", "think", "harmony"] | None = None
    compile: Literal["on", "off", "auto"] | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = None
    weights: Literal["auto", "quantized", "dequantized"] | None = None
    batch_buckets: list[int] | None = None
    prompt_buckets: list[int] | None = None
    capacity_buckets: list[int] | None = None
    max_sequences: int | None = Field(default=None, ge=1)
    warmup_prompt_tokens: int | None = Field(default=None, ge=0)
    warmup_batch: int | None = Field(default=None, ge=1)
    speculative: Literal["off", "lookup", "draft"] | None = None
    draft_model: Path | None = None
    speculative_tokens: int | None = Field(default=None, ge=1, le=16)
    speculative_max_batch: int | None = Field(default=None, ge=1)
    load: Literal["startup", "on_demand"] | None = None  # None: "startup"
    ttl_s: float | None = Field(default=None, gt=0)
    on_demand_wait: Literal["wait", "503"] | None = None
    kv_bits: int | None = None  # None: the top-level kv_bits
    kv_pool_tokens: int | None = Field(default=None, ge=1)  # None: the top-level kv_pool_tokens

    @field_validator("batch_buckets", "prompt_buckets", "capacity_buckets")
    @classmethod
    def _check_buckets(cls, values: list[int] | None) -> list[int] | None:
        return None if values is None else ascending(values)

    @field_validator("kv_bits")
    @classmethod
    def _check_kv_bits(cls, bits: int | None) -> int | None:
        return check_kv_bits(bits)


def name_of(path: Path) -> str:
    """The name a model at ``path`` (a ``model`` value) is served under when no ``model_name``
    is given: a directory's name (``/models/Llama-3.1-8B-4bit`` -> ``Llama-3.1-8B-4bit``; ``.``
    -> the current directory's), a file's stem (``Llama-3.2-1B-Instruct-Q4_K_M.gguf`` ->
    ``Llama-3.2-1B-Instruct-Q4_K_M``), a Hugging Face repo id as written less any ``hf.co/``
    and ``@REVISION`` (``ORG/NAME``, ``ORG/NAME:Q4_K_M``: the id mlx_lm.server and vLLM list).
    Nothing is read or downloaded; a path that does not exist is named as a directory unless it
    ends in ``.gguf``."""
    ref = repo_id_of(path)
    if ref is not None:
        return str(RepoRef(ref.repo, None, ref.tag))
    if path.name in ("", ".", ".."):
        path = path.resolve()
    return path.stem if path.is_file() or path.suffix.lower() == ".gguf" else path.name


def check_kv_bits(bits: int | None) -> int | None:
    """``bits`` when it is a ``kv_bits`` value (4, 8, or None: the compute dtype). Raises
    ValueError otherwise."""
    if bits is not None and bits not in (4, 8):
        raise ValueError(f"kv_bits must be 4 or 8 (got {bits}), or unset for full-precision KV")
    return bits


@dataclass(frozen=True)
class ServedModel:
    """One model to serve with every setting resolved (its ``[[models]]`` value, else the
    top-level one); see :meth:`Settings.served_models`. ``path`` None: the default model."""

    name: str
    path: Path | None
    compile: Literal["on", "off", "auto"]
    dtype: Literal["auto", "float32", "float16", "bfloat16"]
    weights: Literal["auto", "quantized", "dequantized"]
    batch_buckets: list[int]
    prompt_buckets: list[int]
    capacity_buckets: list[int]
    max_sequences: int | None  # None until start-up derives it from the memory budget
    warmup_prompt_tokens: int | None  # None: every prompt length
    warmup_batch: int | None  # None: max_sequences
    speculative: Literal["off", "lookup", "draft"] = "off"
    draft_model: Path | None = None
    speculative_tokens: int = 4
    speculative_max_batch: int | None = None  # None: calibrated at warm-up
    model_impl: Literal["auto", "native", "mlx_lm"] = "auto"
    reasoning_parser: Literal["auto", "none", "think", "harmony"] = "auto"
    load: Literal["startup", "on_demand"] = "startup"
    ttl_s: float | None = None  # seconds idle before an on-demand model is unloaded (None: kept)
    on_demand_wait: Literal["wait", "503"] = "wait"  # a request while it loads: waits, or 503 + Retry-After
    kv_bits: int | None = None  # its paged pool's quantization (4 or 8 bits; None: the compute dtype)
    kv_pool_tokens: int | None = None  # its paged pool's token positions (None: its share of the budget)

    @property
    def embedding(self) -> bool:
        """Whether this is an embedding model (served on ``/v1/embeddings`` only): its path is a
        sentence-transformers directory or a BERT checkpoint (:func:`models.embedding_dir.is_embedding_model`)."""
        return self.path is not None and is_embedding_model(self.path)


# ModelSettings field -> the top-level Settings field it inherits from.
INHERITED = {
    "name": "model_name",
    "path": "model",
    "model_impl": "model_impl",
    "reasoning_parser": "reasoning_parser",
    "compile": "compile",
    "dtype": "dtype",
    "weights": "weights",
    "batch_buckets": "batch_buckets",
    "prompt_buckets": "prompt_buckets",
    "capacity_buckets": "capacity_buckets",
    "max_sequences": "max_sequences",
    "warmup_prompt_tokens": "warmup_prompt_tokens",
    "warmup_batch": "warmup_batch",
    "speculative": "speculative",
    "draft_model": "draft_model",
    "speculative_tokens": "speculative_tokens",
    "speculative_max_batch": "speculative_max_batch",
    "on_demand_wait": "on_demand_wait",
    "kv_bits": "kv_bits",
    "kv_pool_tokens": "kv_pool_tokens",
}
