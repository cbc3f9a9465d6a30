"""The FastAPI app factory: load the model, start the engine and warm it up, serve."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Callable

import mlx.core as mx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from models.gguf import default_model_path
from models.loader import LoadedModel, device_name, load_model
from service import __version__
from service import openai_api
from service.api import router
from service.buckets import BucketTable
from service.compile_cache import CompileCache
from service.config import Settings
from service.engine import Engine, WarmupSpec
from service.errors import install_error_handlers
from service.metrics import Metrics
from service.middleware import BodyLimitMiddleware, StatusCountMiddleware
from service.state import AppState

log = logging.getLogger("stepserve")
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


def load_default(settings: Settings) -> LoadedModel:
    """Load the configured model (the default GGUF when ``settings.model`` is unset).

    Raises:
        ModelLoadError: the file is missing, unreadable or unsupported.
    """
    path = settings.model or default_model_path()
    return load_model(path, settings.model_name, compute_dtype(settings.dtype), weights_mode(settings.weights))


def create_app(
    settings: Settings,
    model: LoadedModel | None = None,
    progress: Callable[[int, str], None] | None = None,
) -> FastAPI:
    """Build the app. The model is loaded (unless given) and warmed up in the lifespan;
    ``/healthz`` answers at once and ``/readyz`` turns 200 when warm-up is done."""
    metrics = Metrics(CollectorRegistry(), version=__version__, device=device_name())
    cache = CompileCache(settings.compile == "on", metrics.record_lookup, metrics.record_compile)
    buckets = BucketTable(tuple(settings.batch_buckets), tuple(settings.prompt_buckets), tuple(settings.capacity_buckets))
    state = AppState(settings, metrics, cache, settings.model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loaded = model or load_default(settings)
        engine = Engine(loaded, buckets, cache, metrics, settings.max_waiting, settings.max_admit)
        state.engines[loaded.name] = engine
        state.default_model = loaded.name
        log.info("model %s: %s, %.0f MB, %s weights, %s compute, compile %s", loaded.name, loaded.path,
                 loaded.nbytes / 1e6, loaded.weights, loaded.dtype, settings.compile)
        positions = settings.warmup_prompt_tokens + settings.default_max_tokens
        engine.start(WarmupSpec(settings.warmup_prompt_tokens, settings.warmup_batch, positions), progress)
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="stepserve", version=__version__, lifespan=lifespan,
                  description="MLX inference with compiled, bucketed prefill and decode steps.")
    app.state.stepserve = state
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(openai_api.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(StatusCountMiddleware, metrics=metrics)
    return app
