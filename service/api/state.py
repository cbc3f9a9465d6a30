"""What the app holds while it runs (built by the lifespan, read by the routes), and the
``State`` dependency that hands it to a route."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from service.api.response_store import ResponseStore
from service.config import Settings
from service.engine.core import Engine
from service.engine.embedder import Embedder
from service.metrics import Metrics
from service.process.group import RankInfo
from service.process.warm_sizing import Coverage


@dataclass
class AppState:
    """Settings, metrics, one engine per served chat model (the first is the default), one
    embedder per embedding model and the kept ``/v1/responses`` answers."""

    settings: Settings
    metrics: Metrics
    default_model: str
    engines: dict[str, Engine] = field(default_factory=dict)
    embedders: dict[str, Embedder] = field(default_factory=dict)  # the embedding models (/v1/embeddings)
    started: int = field(default_factory=lambda: int(time.time()))  # Unix seconds, /v1/models' ``created``
    draining: bool = False  # SIGTERM received: refuse new work, finish what runs
    ranks: list[RankInfo] | None = None  # a pipeline group's ranks, on its rank 0 (None: one process)
    coverage: dict[str, Coverage] = field(default_factory=dict)  # what each model's warm-up covers, and why
    responses: ResponseStore = field(init=False)  # /v1/responses answers kept (responses_store_bytes)

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.settings.responses_store_bytes)


async def get_state(request: Request) -> AppState:
    """The app's :class:`AppState`. A coroutine on purpose: FastAPI runs a plain ``def``
    dependency in its thread pool, and that trip (out to a worker and back to the event loop)
    waits twice for the GIL, each time up to the switch interval while the engine thread runs
    Python, on every request."""
    return request.app.state.stepserve


State = Annotated[AppState, Depends(get_state)]
