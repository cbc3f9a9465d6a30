"""The FastAPI app factory: load the model, start the engine and warm it up, serve."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

import mlx.core as mx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from models.gguf import default_model_path
from models.loader import LoadedModel, device_name, load_model
from service import __version__
from service.api import openai as openai_api
from service.api import security
from service.api.errors import install_error_handlers
from service.api.middleware import BodyLimitMiddleware, StatusCountMiddleware
from service.api.routes import router
from service.api.state import AppState
from service.config import ModelSettings, Settings
from service.engine.buckets import BucketTable
from service.engine.compile_cache import CompileCache
from service.engine.core import Engine, WarmupSpec
from service.metrics import Metrics
from service.process import memory
from service.process.memory import MemoryEstimate
from service.process.watchdog import EngineWatchdog

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


def create_app(
    settings: Settings,
    models: dict[str, LoadedModel] | None = None,
    progress: Callable[[int, str], None] | None = None,
) -> FastAPI:
    """Build the app. Models are loaded (unless given) and warmed up in the lifespan;
    ``/healthz`` answers at once and ``/readyz`` turns 200 when every warm-up is done."""
    metrics = Metrics(CollectorRegistry(), version=__version__, device=device_name())
    specs = settings.served_models()
    state = AppState(settings, metrics, specs[0].name)
    watchdog = EngineWatchdog(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loaded = models or load_models(settings)
        for spec in specs:
            model = loaded[spec.name]
            cache = CompileCache(spec.compile, metrics.record_lookup, metrics.record_compile)
            engine = Engine(
                model, buckets_of(spec), cache, metrics, settings.max_waiting, settings.max_admit, spec.max_sequences
            )
            state.engines[spec.name] = engine
            log.info(
                "model %s: %s, %.0f MB, %s weights, %s compute, compile %s",
                model.name,
                model.path,
                model.nbytes / 1e6,
                model.weights,
                model.dtype,
                spec.compile,
            )
            positions = spec.warmup_prompt_tokens + settings.default_max_tokens
            engine.start(WarmupSpec(spec.warmup_prompt_tokens, spec.warmup_batch, positions), progress)
        watchdog.start()
        try:
            yield
        finally:
            watchdog.stop()
            for engine in state.engines.values():
                engine.stop()

    app = FastAPI(
        title="stepserve",
        version=__version__,
        lifespan=lifespan,
        description="MLX inference with compiled, bucketed prefill and decode steps.",
    )
    app.state.stepserve = state
    app.state.watchdog = watchdog  # `stepserve serve` exits with its exit_code
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(openai_api.router)
    # The middleware added last runs first: CORS, request counting, API key, body bounds.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_s=settings.read_timeout_s)
    security.add_auth(app, settings)
    app.add_middleware(StatusCountMiddleware, metrics=metrics)
    security.add_cors(app, settings)
    security.warn_if_exposed(settings)
    return app
