"""What the app holds while it runs (built by the lifespan, read by the routes), and the
``State`` dependency that hands it to a route."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from service.api import reasoning
from service.api.reasoning import Parser
from service.api.response_store import ResponseStore
from service.config import Settings
from service.engine.core import Engine
from service.engine.embedder import Embedder
from service.metrics import Metrics
from service.process.group import RankInfo
from service.process.on_demand import ModelState, OnDemandModels
from service.process.warm_sizing import Coverage


@dataclass
class AppState:
    """Settings, metrics, one engine per served chat model (the first is the default; an
    on-demand model's only while loaded), one embedder per embedding model and the kept
    ``/v1/responses`` answers."""

    settings: Settings
    metrics: Metrics
    default_model: str
    on_demand: OnDemandModels  # the models loaded on demand (its ``engines`` are these)
    engines: dict[str, Engine] = field(default_factory=dict)
    embedders: dict[str, Embedder] = field(default_factory=dict)  # the embedding models (/v1/embeddings)
    started: int = field(default_factory=lambda: int(time.time()))  # Unix seconds, /v1/models' ``created``
    draining: bool = False  # SIGTERM received: refuse new work, finish what runs
    ranks: list[RankInfo] | None = None  # a pipeline group's ranks, on its rank 0 (None: one process)
    coverage: dict[str, Coverage] = field(default_factory=dict)  # what each model's warm-up covers, and why
    reasoning: dict[str, Parser | None] = field(default_factory=dict)  # resolved reasoning parsers (reasoning_of)
    responses: ResponseStore = field(init=False)  # /v1/responses answers kept (responses_store_bytes)
    model_names: list[str] = field(init=False)  # every served model, in the settings' order

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.settings.responses_store_bytes)
        self.model_names = [spec.name for spec in self.settings.served_models()]

    def reasoning_of(self, engine: Engine) -> Parser | None:
        """The reasoning parser of ``engine``'s model: its ``reasoning_parser`` setting resolved
        against its chat template (:func:`service.api.reasoning.resolve`) on first use, then kept
        (an on-demand model's tokenizer exists only once it is loaded)."""
        name = engine.model.name
        if name not in self.reasoning:
            spec = next(s for s in self.settings.served_models() if s.name == name)
            self.reasoning[name] = reasoning.resolve(spec.reasoning_parser, engine.model.tokenizer.chat_template)
        return self.reasoning[name]

    def model_state(self, name: str) -> ModelState:
        """``name``'s state: an on-demand model's own; a start-up model is ``loading`` until its
        warm-up is over."""
        if name in self.on_demand:
            return self.on_demand.state(name)
        engine = self.engines.get(name) or self.embedders.get(name)
        return ModelState.LOADED if engine is not None and engine.ready.is_set() else ModelState.LOADING


async def get_state(request: Request) -> AppState:
    """The app's :class:`AppState`. A coroutine on purpose: FastAPI runs a plain ``def``
    dependency in its thread pool, and that trip (out to a worker and back to the event loop)
    waits twice for the GIL, each time up to the switch interval while the engine thread runs
    Python, on every request."""
    return request.app.state.stepserve


State = Annotated[AppState, Depends(get_state)]
