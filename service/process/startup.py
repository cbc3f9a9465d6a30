"""Start-up: resolve each model's dtype and weight format, load the models, and check their
worst-case memory against the budget before anything is served."""

from __future__ import annotations

import logging

import mlx.core as mx

from models.gguf import default_model_path
from models.loader import LoadedModel, device_name, load_model
from service.config import ModelSettings, Settings
from service.engine.buckets import BucketTable
from service.process import memory
from service.process.memory import MemoryEstimate

log = logging.getLogger("stepserve")


class MemoryBudgetError(RuntimeError):
    """The configured models may need more memory than ``memory_budget_bytes``."""


_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def compute_dtype(setting: str) -> mx.Dtype:
    """The compute dtype: ``auto`` is float16 on a GPU and float32 on the CPU, where float16
    matmuls measured ~30x slower (README, "Compute dtype")."""
    if setting == "auto":
        return mx.float16 if device_name() == "gpu" else mx.float32
    return _DTYPES[setting]


def weights_mode(setting: str) -> str:
    """``auto`` keeps weights quantized on a GPU (memory is what limits a Mac mini) and
    dequantizes them on the CPU, where dense float32 matmuls measured 2.4x faster per
    decode step and 33x per prefill (README, "Weights and dtype")."""
    if setting == "auto":
        return "quantized" if device_name() == "gpu" else "dequantized"
    return setting


def load_models(settings: Settings) -> dict[str, LoadedModel]:
    """Load every configured model (the default GGUF where no path is set), in order.

    Raises:
        ModelLoadError: a file is missing, unreadable or unsupported (the message names it).
    """
    return {
        spec.name: load_model(
            spec.path or default_model_path(), spec.name, compute_dtype(spec.dtype), weights_mode(spec.weights)
        )
        for spec in settings.served_models()
    }


def buckets_of(spec: ModelSettings) -> BucketTable:
    return BucketTable(tuple(spec.batch_buckets), tuple(spec.prompt_buckets), tuple(spec.capacity_buckets))


def check_memory(settings: Settings, models: dict[str, LoadedModel]) -> list[MemoryEstimate]:
    """Worst-case memory of every model. Raises MemoryBudgetError over ``memory_budget_bytes``,
    or over ``mlx_memory_limit_bytes`` (MLX's memory limit, where set) when no budget is given."""
    estimates = [
        memory.estimate(
            models[spec.name], buckets_of(spec), spec.max_sequences or spec.batch_buckets[-1], settings.max_admit
        )
        for spec in settings.served_models()
    ]
    total = sum(e.total for e in estimates)
    for e in estimates:
        log.info("memory estimate: %s", e.describe())
    name, budget = (
        ("memory_budget_bytes", settings.memory_budget_bytes)
        if settings.memory_budget_bytes
        else ("mlx_memory_limit_bytes", settings.mlx_memory_limit_bytes)
    )
    if budget is not None and total > budget:
        lines = "; ".join(e.describe() for e in estimates)
        raise MemoryBudgetError(
            f"the models need up to {total / 1e9:.2f} GB, over {name} {budget / 1e9:.2f} GB ({lines}); "
            "lower max_sequences or the largest capacity bucket, or serve fewer models"
        )
    if total > mx.get_memory_limit():
        log.warning(
            "worst-case memory %.2f GB exceeds MLX's memory limit %.2f GB", total / 1e9, mx.get_memory_limit() / 1e9
        )
    return estimates
