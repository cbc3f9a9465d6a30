"""Models loaded on demand: a ``[[models]]`` entry with ``load = "on_demand"`` is loaded by its
first request and unloaded after ``ttl_s`` seconds idle.

A load runs off the event loop: the weights are read (:func:`service.process.startup.load_served`),
the model's worst case is checked against the memory budget beside every model loaded now (the
embedding models' weights and largest steps included) and its ``max_sequences`` resolved as at
start-up (:func:`service.process.startup.check_memory`), then its engine is built and started,
and warms up in its own thread as a start-up model does. The engine joins the served engines
when it starts (its HTTP rehearsal goes through the routes) and serves once ready; from then
on, memory admission (:func:`service.process.memory.admit`) counts it as any other. Requests
that arrive while it loads wait for it (``on_demand_wait = "wait"``) or are answered 503 with
``Retry-After`` (``"503"``), the seconds its previous load took, else :data:`FIRST_LOAD_RETRY_S`.

A loaded model is idle when it runs and queues nothing; once it has been idle and unasked for
``ttl_s`` seconds, it leaves the served engines, its engine thread stops and its weights and
caches are freed (MLX's buffer cache emptied). The next request loads it again.

States (``GET /v1/models``, ``stepserve_model_state``): ``unloaded``, ``loading``, ``loaded``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import mlx.core as mx

from models.loader import LoadedModel
from models.sentence import EmbeddingModel
from service.config import ServedModel, Settings
from service.engine.core import Engine
from service.metrics import Metrics
from service.process.startup import check_memory, draft_name, load_served

log = logging.getLogger("stepserve.on_demand")

FIRST_LOAD_RETRY_S = 5  # Retry-After while a model loads for the first time (no earlier load to go by)
READY_POLL_S = 0.05  # how often a load checks whether its engine's warm-up is over


class ModelState(StrEnum):
    """Where a served model is (``GET /v1/models``' ``state``)."""

    LOADED = "loaded"
    LOADING = "loading"
    UNLOADED = "unloaded"


class ModelLoading(Exception):
    """The model is loading and its ``on_demand_wait`` is ``"503"`` (HTTP 503).

    Attributes:
        retry_after_s: whole seconds the load is expected to go on.
    """

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadFailed(Exception):
    """The model could not be loaded (missing files, over the memory budget, warm-up failed);
    the message says why. It stays unloaded: a later request tries again."""


#: Builds and starts a served model's engine (its warm-up in its thread): the app's own
#: builder (:func:`service.api.app._start_engine`), given the model's resolved settings, the
#: model and its draft model or None. Called on the event loop.
StartEngine = Callable[[ServedModel, LoadedModel, LoadedModel | None], Engine]


@dataclass
class _Slot:
    """One on-demand model: its settings, its state and what it holds while loaded."""

    spec: ServedModel
    state: ModelState = ModelState.UNLOADED
    loading: asyncio.Task[Engine] | None = None
    unloading: asyncio.Task[None] | None = None
    started: float = 0.0  # time.monotonic() the current load began
    last_used: float = 0.0  # time.monotonic() of its last request, or of its last busy check
    load_s: float | None = None  # seconds its last successful load took
    models: dict[str, LoadedModel] = field(default_factory=dict)  # the model and its draft, while loaded


class OnDemandModels:
    """The on-demand models of a server (see the module doc).

    Args:
        settings: the server's settings (``max_sequences`` resolved for the start-up models).
        engines: the served engines by name (the app's dict: a loaded model's engine joins it).
        metrics: where the state, loads and unloads are recorded.
        start: builds and starts an engine (:data:`StartEngine`).
    """

    def __init__(self, settings: Settings, engines: dict[str, Engine], metrics: Metrics, start: StartEngine):
        self.settings, self.engines, self.metrics, self._start = settings, engines, metrics, start
        self._resident: dict[str, LoadedModel] = {}  # the start-up models, counted in each memory check
        self._embedders: dict[str, EmbeddingModel] = {}  # the embedding models, counted likewise
        self._slots = {s.name: _Slot(s) for s in settings.served_models() if s.load == "on_demand"}
        for name in self._slots:
            metrics.init_on_demand(name)
        self._reaper: asyncio.Task[None] | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def state(self, name: str) -> ModelState:
        """An on-demand model's state."""
        return self._slots[name].state

    async def engine(self, name: str) -> Engine:
        """The ready engine of on-demand model ``name``, loading it first if need be.

        Raises:
            ModelLoading: it is loading and its ``on_demand_wait`` is ``"503"``.
            ModelLoadFailed: this load failed (the message says why).
        """
        slot = self._slots[name]
        slot.last_used = time.monotonic()
        if slot.state is ModelState.LOADED:
            return self.engines[name]
        if slot.loading is None:
            slot.loading = asyncio.create_task(self._load(slot))
            slot.loading.add_done_callback(lambda _: setattr(slot, "loading", None))
        if slot.spec.on_demand_wait == "503":
            raise ModelLoading(f"model '{name}' is loading; retry later", self._retry_after(slot))
        return await asyncio.shield(slot.loading)

    def _retry_after(self, slot: _Slot) -> int:
        if slot.load_s is None:
            return FIRST_LOAD_RETRY_S
        return max(1, math.ceil(slot.load_s - (time.monotonic() - slot.started)))

    async def _load(self, slot: _Slot) -> Engine:
        """Load ``slot``'s model, start its engine and wait until it is ready (see the module doc)."""
        name = slot.spec.name
        if slot.unloading is not None:  # its previous engine is still stopping
            await slot.unloading
        slot.state, slot.started = ModelState.LOADING, time.monotonic()
        self.metrics.set_model_state(name, slot.state)
        log.info("model %s: loading on demand", name)
        try:
            spec, models = await asyncio.to_thread(self._read, slot.spec)
            engine = self._start(spec, models[name], models.get(draft_name(name)))
            self.engines[name] = engine
            ready = await asyncio.to_thread(_wait_ready, engine)
            if not ready:
                self.engines.pop(name, None)
                raise ModelLoadFailed(f"model '{name}' could not be loaded: {engine.not_ready_reason}")
        except Exception as exc:
            slot.state = ModelState.UNLOADED
            self.metrics.set_model_state(name, slot.state)
            self.metrics.model_loads.labels(name, "failed").inc()
            log.error("model %s: loading on demand failed: %s", name, exc)
            if isinstance(exc, ModelLoadFailed):
                raise
            raise ModelLoadFailed(f"model '{name}' could not be loaded: {exc}") from exc
        slot.models, slot.load_s = models, time.monotonic() - slot.started
        slot.state, slot.last_used = ModelState.LOADED, time.monotonic()
        self.metrics.set_model_state(name, slot.state)
        self.metrics.model_loads.labels(name, "loaded").inc()
        self.metrics.model_load_seconds.labels(name).observe(slot.load_s)
        log.info("model %s: loaded on demand in %.1f s (max_sequences %s)", name, slot.load_s, spec.max_sequences)
        return engine

    def _read(self, spec: ServedModel) -> tuple[ServedModel, dict[str, LoadedModel]]:
        """(``spec`` with ``max_sequences`` resolved, its model and draft), read from disk and
        checked against the memory budget beside every model loaded now (a worker thread).

        Raises:
            ModelLoadError: the files cannot be read; MemoryBudgetError: it does not fit.
        """
        models = load_served(spec, paged=self.settings.kv_cache == "paged")
        held = dict(self._resident)
        for slot in self._slots.values():
            held |= slot.models
        resolved = check_memory(self.settings, held | models, self._embedders)
        return next(s for s in resolved.served_models() if s.name == spec.name), models

    def start(self, loaded: dict[str, LoadedModel], embedders: dict[str, EmbeddingModel] | None = None) -> None:
        """Serve: ``loaded`` (the start-up models and drafts by name) and ``embedders`` (the
        embedding models) are counted in each load's memory check; models idle for their
        ``ttl_s`` are unloaded (a task on the running loop)."""
        self._resident, self._embedders = dict(loaded), dict(embedders or {})
        ttls = [s.spec.ttl_s for s in self._slots.values() if s.spec.ttl_s is not None]
        if ttls:
            self._reaper = asyncio.create_task(self._reap(poll_s=min(1.0, min(ttls) / 4)))

    async def _reap(self, poll_s: float) -> None:
        while True:
            await asyncio.sleep(poll_s)
            now = time.monotonic()
            for slot in self._slots.values():
                ttl = slot.spec.ttl_s
                if slot.state is not ModelState.LOADED or ttl is None:
                    continue
                if not self.engines[slot.spec.name].idle:
                    slot.last_used = now
                elif now - slot.last_used >= ttl:
                    self._retire(slot, now - slot.last_used)

    def _retire(self, slot: _Slot, idle_s: float) -> None:
        """Take ``slot``'s engine out of service now (the next request loads the model again) and
        stop it in a task. No local of the reaper's loop may keep the engine: its memory is freed
        once the task has dropped it."""
        engine = self.engines.pop(slot.spec.name)
        slot.state, slot.models = ModelState.UNLOADED, {}
        self.metrics.set_model_state(slot.spec.name, slot.state)
        slot.unloading = asyncio.create_task(self._unload(slot, engine, idle_s))

    async def _unload(self, slot: _Slot, engine: Engine, idle_s: float) -> None:
        """Stop ``slot``'s engine (out of service already) and free its memory."""
        name = slot.spec.name
        before = mx.get_active_memory()
        await asyncio.to_thread(engine.stop)
        self.metrics.release_model(name)
        del engine
        gc.collect()
        mx.clear_cache()
        self.metrics.model_unloads.labels(name).inc()
        log.info(
            "model %s: unloaded after %.1f s idle (ttl_s %.1f; MLX active memory %.1f -> %.1f MB)",
            name,
            idle_s,
            slot.spec.ttl_s,
            before / 1e6,
            mx.get_active_memory() / 1e6,
        )
        slot.unloading = None

    def stop(self) -> None:
        """Stop unloading (the server is stopping; the app stops every engine left)."""
        if self._reaper is not None:
            self._reaper.cancel()


def _wait_ready(engine: Engine) -> bool:
    """Block until ``engine`` is ready (True) or its thread ended without getting there (False)."""
    while not engine.ready.wait(READY_POLL_S):
        if not engine.alive:
            return engine.ready.is_set()
    return True
