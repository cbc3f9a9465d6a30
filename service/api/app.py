"""The FastAPI app factory: load the model, start the engine and warm it up, serve."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from models.loader import LoadedModel, device_name
from models.sentence import EmbeddingModel
from service import __version__
from service.api import anthropic as anthropic_api
from service.api import embeddings as embeddings_api
from service.api import openai as openai_api
from service.api import rehearsal, security
from service.api import responses as responses_api
from service.api.docs import install_docs
from service.api.errors import install_error_handlers
from service.api.middleware import BodyLimitMiddleware, StatusCountMiddleware
from service.api.routes import router
from service.api.state import AppState
from service.config import ServedModel, Settings
from service.engine.core import Engine
from service.metrics import Metrics
from service.process.build import build_embedder, build_engine, embed_warmup, start_engine, warmup_spec
from service.process.group import RankInfo
from service.process.on_demand import OnDemandModels
from service.process.startup import draft_name, load_embedders, load_models
from service.process.watchdog import EngineWatchdog

log = logging.getLogger("stepserve")


def create_app(
    settings: Settings,
    models: dict[str, LoadedModel] | None = None,
    progress: Callable[[int, str], None] | None = None,
    ranks: list[RankInfo] | None = None,
    embedders: dict[str, EmbeddingModel] | None = None,
) -> FastAPI:
    """Build the app. Models and embedding models are loaded (unless given: ``models``,
    ``embedders``) and warmed up in the lifespan; ``/healthz`` answers at once and ``/readyz``
    turns 200 when every warm-up is done. ``ranks``: a pipeline group's ranks, when this is its
    rank 0 (``models`` is then its stage). The watchdog watches the engine and embedding threads."""
    metrics = Metrics(CollectorRegistry(), version=__version__, device=device_name())
    specs = settings.chat_models()
    engines: dict[str, Engine] = {}

    def start_on_demand(spec: ServedModel, model: LoadedModel, draft: LoadedModel | None) -> Engine:
        return _start_engine(settings, spec, model, metrics, None, draft, app)

    on_demand = OnDemandModels(settings, engines, metrics, start_on_demand)
    state = AppState(settings, metrics, (specs or settings.served_models())[0].name, on_demand, engines, ranks=ranks)
    stall_limit = settings.distributed_timeout_s if ranks else None
    watchdog = EngineWatchdog(
        state.engines, settings.shutdown_grace_s, stall_limit_s=stall_limit, embedders=state.embedders
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loaded = models or load_models(settings)
        for spec in specs:
            if spec.load == "startup":
                draft = loaded.get(draft_name(spec.name))
                engine = _start_engine(settings, spec, loaded[spec.name], metrics, progress, draft, app)
                state.engines[spec.name] = engine
        encoders = embedders if embedders is not None else load_embedders(settings)
        on_demand.start(loaded, encoders)  # each on-demand load's memory check counts them
        for spec in settings.embedding_models():
            embedder = state.embedders[spec.name] = build_embedder(spec, encoders[spec.name], metrics)
            embedder.start(embed_warmup(spec, embedder))
        watchdog.start()
        try:
            yield
        finally:
            on_demand.stop()
            watchdog.stop()
            for engine in list(state.engines.values()):
                engine.stop()
            for embedder in state.embedders.values():
                embedder.stop()

    app = FastAPI(
        title="stepserve",
        version=__version__,
        lifespan=lifespan,
        description="MLX inference with compiled, bucketed prefill and decode steps.",
        docs_url=None,  # served from local files by install_docs
        redoc_url=None,
    )
    app.state.stepserve = state
    app.state.watchdog = watchdog  # `stepserve serve` exits with its exit_code
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(responses_api.router)
    app.include_router(embeddings_api.router)
    install_docs(app)
    # The middleware added last runs first: CORS, request counting, API key, body bounds.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_s=settings.read_timeout_s)
    security.add_auth(app, settings)
    app.add_middleware(StatusCountMiddleware, metrics=metrics)
    security.add_cors(app, settings)
    security.warn_if_exposed(settings)
    return app


def _start_engine(
    settings: Settings,
    spec: ServedModel,
    model: LoadedModel,
    metrics: Metrics,
    progress: Callable[[int, str], None] | None,
    draft: LoadedModel | None = None,
    app: FastAPI | None = None,
) -> Engine:
    """Build ``model``'s engine (:func:`service.process.build.build_engine`; ``draft``: its draft
    model) and start its thread, which warms up (with the app's HTTP rehearsal), then serves."""
    engine = build_engine(settings, spec, model, metrics, draft)
    warmup, coverage = warmup_spec(settings, spec, engine)
    if app is not None:  # /readyz says what is warm
        app.state.stepserve.coverage[spec.name] = coverage
    http = None if app is None else _http_rehearsal(app, spec.name, model, settings, warmup.batch, warmup.prompt_tokens)
    return start_engine(engine, warmup, progress, http)


def _http_rehearsal(
    app: FastAPI, name: str, model: LoadedModel, settings: Settings, streams: int, prompt_tokens: int
) -> Callable[[], Future[list[str]]]:
    """What starts ``name``'s HTTP rehearsal (:func:`service.api.rehearsal.run`: each route,
    then a burst of ``streams`` requests, the warmed concurrency; prompts within the warmed
    ``prompt_tokens``) on the running event loop, from the engine thread."""
    loop = asyncio.get_running_loop()
    key = settings.api_key.get_secret_value() if settings.api_key else None
    limit = min(prompt_tokens, 256)  # the burst's prompts: up to a few hundred tokens
    return lambda: asyncio.run_coroutine_threadsafe(
        rehearsal.run(app, name, model.tokenizer, key, streams, limit), loop
    )
