"""An embedding model in the memory budget, on the real all-MiniLM-L6-v2: its weights and its
largest step's activations (the estimate bounds the peak MLX measures for a compiled step) are
taken off the same budget as the chat models' at start-up and at an on-demand load, and a
configuration that does not fit is refused naming the embedding model, its figures and the fix.
Per request, memory admission counts the embedding models beside the chat models: their weights
always, and the step their queued inputs can make, for a chat request and for an embedding
request (``/v1/embeddings`` answers 503 naming ``input``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from models.embedding_dir import packaged_minilm
from models.loader import LoadedModel
from models.sentence import EmbeddingModel, load_embedding_model
from service.api.app import create_app
from service.config import Settings
from service.engine.buckets import BucketTable
from service.engine.compile_cache import CompileCache
from service.engine.embedder import Embedder
from service.metrics import Metrics
from service.process import memory, startup
from service.process.memory import (
    MemoryAdmissionError,
    admit,
    admit_embedding,
    embedder_load_bytes,
    embedding_worst_case,
    kv_bytes_per_position,
    load_bytes,
    worst_case,
)
from service.process.on_demand import OnDemandModels
from service.process.startup import MemoryBudgetError, buckets_of, check_memory
from tests.support import TINY, WordTokenizer, engine_at, random_params

EMBED_BATCHES = [1, 8, 64]


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory) -> Path:
    return packaged_minilm(tmp_path_factory.mktemp("minilm"))


@pytest.fixture(scope="module")
def minilm(minilm_dir) -> EmbeddingModel:
    return load_embedding_model(minilm_dir, "minilm", mx.float32)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    tokenizer = WordTokenizer(frozenset())
    return LoadedModel("tiny", Path("-"), TINY, random_params(seed=1), tokenizer, mx.float32, "dequantized", 0.0)  # type: ignore[arg-type]


def settings(minilm_dir: Path, chat: bool = True, **keys: Any) -> Settings:
    """A chat model "tiny" (unless ``chat`` is False) and the embedding model "minilm"; ``keys``
    override any setting."""
    models: list[dict[str, Any]] = [{"name": "tiny"}] if chat else []
    models.append({"name": "minilm", "path": str(minilm_dir), "batch_buckets": EMBED_BATCHES})
    base: dict[str, Any] = dict(
        models=models, batch_buckets=[1, 2, 4], prompt_buckets=[16, 32], capacity_buckets=[32, 64]
    )
    base |= dict(prefix_cache_bytes=0, prefill_chunk_tokens=32, max_batched_tokens=64)
    return Settings(**{**base, **keys})


def peak_of_compiled_step(model: EmbeddingModel, batch: int, length: int) -> int:
    """Bytes MLX allocates beyond what was live while running the compiled encoder on a
    [batch, length] batch (as the embedder runs it), its compilation done before."""
    step = mx.compile(model.embed)
    ids = mx.ones((batch, length), mx.int32)
    mx.eval(step(ids, ids))
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(step(ids, ids))
    return mx.get_peak_memory() - before


@pytest.mark.parametrize("dtype, batch, length", [("float32", 8, 128), ("float32", 2, 256), ("float16", 4, 64)])
def test_the_step_estimate_bounds_the_measured_peak_of_a_compiled_step(minilm_dir, minilm, dtype, batch, length):
    model = minilm if dtype == "float32" else load_embedding_model(minilm_dir, "minilm", getattr(mx, dtype))
    estimate = model.args.step_bytes(batch, length, model.dtype.size)
    measured = peak_of_compiled_step(model, batch, length)
    assert measured <= estimate < 2 * measured  # a bound, and close enough not to waste the budget


def test_the_weights_are_the_encoders_parameters_in_the_compute_dtype(minilm):
    a = minilm.args
    h, i = a.hidden_size, a.intermediate_size
    embeddings = (a.vocab_size + a.max_position_embeddings + a.type_vocab_size) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    assert minilm.nbytes == 4 * (embeddings + a.num_hidden_layers * layer)  # float32; no pooler head


def test_the_worst_case_is_the_largest_batch_bucket_at_the_longest_input(minilm):
    e = embedding_worst_case(minilm, EMBED_BATCHES, (16, 32, minilm.max_tokens))
    assert (e.batch, e.length) == (64, 256)
    assert e.total == minilm.nbytes + minilm.args.step_bytes(64, 256, 4)
    assert "embedding model 'minilm'" in e.describe() and "largest step b64x256" in e.describe()


def test_embedding_models_alone_over_the_budget_are_refused_naming_the_model_and_the_fix(minilm_dir, minilm):
    need = startup.embedding_estimates(settings(minilm_dir, chat=False), {"minilm": minilm})[0].total
    assert check_memory(settings(minilm_dir, chat=False, memory_budget_bytes=need), {}, {"minilm": minilm})
    with pytest.raises(MemoryBudgetError) as refused:
        check_memory(settings(minilm_dir, chat=False, memory_budget_bytes=need - 1), {}, {"minilm": minilm})
    message = str(refused.value)
    assert "embedding model 'minilm'" in message and "memory_budget_bytes" in message
    assert (
        f"{need / 1e9:.2f} GB" in message and "lower the largest batch bucket of an embedding model (minilm)" in message
    )


def test_an_embedding_model_takes_from_the_chat_models_budget(minilm_dir, minilm, tiny):
    spec = settings(minilm_dir).chat_models()[0]
    chat = {b: worst_case(tiny, buckets_of(spec, tiny), b, 32, 64).total for b in (1, 2, 4)}
    embed = startup.embedding_estimates(settings(minilm_dir), {"minilm": minilm})[0].total

    def resolved(budget: int, embedders: dict | None = None) -> int | None:
        embedders = {"minilm": minilm} if embedders is None else embedders
        checked = check_memory(settings(minilm_dir, memory_budget_bytes=budget), {"tiny": tiny}, embedders)
        return checked.chat_models()[0].max_sequences

    assert resolved(chat[4], embedders={}) == 4
    assert resolved(chat[4] + embed) == 4
    assert resolved(chat[4] + embed - 1) == 2  # what fits 4 sequences alone fits 2 beside the embedder
    with pytest.raises(MemoryBudgetError) as refused:
        resolved(chat[1] + embed - 1)
    message = str(refused.value)
    assert "model 'tiny'" in message and "embedding model 'minilm'" in message
    assert "lower max_sequences or the largest capacity bucket, lower the largest batch bucket" in message


def test_a_paged_pool_gets_what_the_embedding_models_leave(minilm_dir, minilm, tiny):
    embed = startup.embedding_estimates(settings(minilm_dir), {"minilm": minilm})[0].total
    budget = embed + 10**8

    def pool(budget: int, embedders: dict) -> int | None:
        s = settings(minilm_dir, kv_cache="paged", memory_budget_bytes=budget, max_model_len=64)
        return check_memory(s, {"tiny": tiny}, embedders).kv_pool_tokens

    assert pool(budget, {"minilm": minilm}) == pool(budget - embed, {})
    with pytest.raises(MemoryBudgetError, match="beside the embedding models'") as refused:
        pool(embed + tiny.nbytes + 8 * kv_bytes_per_position(tiny), {"minilm": minilm})
    assert "lower the largest batch bucket of an embedding model (minilm)" in str(refused.value)


def test_an_on_demand_load_counts_the_embedding_models(minilm_dir, minilm, tiny, monkeypatch):
    models = [{"name": "tiny", "load": "on_demand"}, {"name": "minilm", "path": str(minilm_dir), "batch_buckets": [64]}]

    def spec_of(budget: int) -> Settings:
        return settings(minilm_dir, chat=False, models=models, batch_buckets=[1], memory_budget_bytes=budget)

    need = worst_case(tiny, buckets_of(spec_of(1).chat_models()[0], tiny), 1, 32, 64).total
    embed = startup.embedding_estimates(spec_of(1), {"minilm": minilm})[0].total
    monkeypatch.setattr("service.process.on_demand.load_served", lambda spec, paged=False: {"tiny": tiny})
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")

    def load(budget: int) -> int | None:
        on_demand = OnDemandModels(spec_of(budget), {}, metrics, start=lambda *_: None)  # type: ignore[arg-type]
        on_demand.start({}, {"minilm": minilm})
        return on_demand._read(spec_of(budget).chat_models()[0])[0].max_sequences

    assert load(need + embed) == 1
    with pytest.raises(MemoryBudgetError, match="embedding model 'minilm'"):
        load(need + embed - 1)


def test_an_on_demand_embedding_model_is_refused(minilm_dir):
    with pytest.raises(ValueError, match="model 'minilm': load = 'on_demand' is not implemented for embedding models"):
        Settings.model_validate({"models": [{"name": "minilm", "path": str(minilm_dir), "load": "on_demand"}]})


def embedder_of(model: EmbeddingModel, metrics: Metrics | None = None) -> Embedder:
    """``model``'s embedder at batch buckets (1, 8, 64) and lengths (16, 32, 256), not started:
    what is submitted stays queued."""
    metrics = metrics or Metrics(CollectorRegistry(), version="test", device="cpu")
    cache = CompileCache("off", metrics.record_lookup, metrics.record_compile)
    return Embedder(model, tuple(EMBED_BATCHES), (16, 32, model.max_tokens), cache, metrics)


@pytest.fixture
def limit(monkeypatch):
    """Set MLX's memory limit as admission reads it (``mx.get_memory_limit``), without MLX's
    own limit changing: ``limit(bytes)``."""

    def set_limit(nbytes: int) -> None:
        monkeypatch.setattr(memory.mx, "get_memory_limit", lambda: nbytes)

    return set_limit


def test_an_embedder_holds_its_weights_and_the_step_its_queued_inputs_make(minilm):
    embedder = embedder_of(minilm)
    assert embedder.load() == [] and embedder_load_bytes(embedder, []) == minilm.nbytes
    embedder.submit([[1] * 10] * 3)
    embedder.submit([[1] * 20])
    assert sorted(embedder.load()) == [10, 10, 10, 20]
    step = memory.embedding_step_bytes
    assert embedder_load_bytes(embedder, embedder.load()) == minilm.nbytes + step(minilm, 8, 32)  # 4 rows: b8, T 32
    many = embedder.load() * 40  # more than a step takes: the largest batch bucket
    assert embedder_load_bytes(embedder, many) == minilm.nbytes + step(minilm, 64, 32)


def test_a_chat_request_is_admitted_against_the_embedding_models_too(minilm, tiny, limit):
    engine = engine_at(tiny, BucketTable(batch=(1, 2), prompt=(16, 32), capacity=(64,)))
    embedder = embedder_of(minilm)
    chat = load_bytes(engine, [(10, 20)])
    limit(chat + minilm.nbytes)
    admit([engine], engine, 10, 20, [embedder])  # fits beside the idle embedder's weights
    admit([engine], engine, 10, 20)  # and without it
    embedder.submit([[1] * 200] * 8)  # its next step: b8 x 256
    with pytest.raises(MemoryAdmissionError) as busy:
        admit([engine], engine, 10, 20, [embedder])
    assert busy.value.retry and "retry later" in busy.value.message
    limit(chat + minilm.nbytes - 1)
    with pytest.raises(MemoryAdmissionError) as never:
        admit([engine], engine, 10, 20, [embedder])
    assert not never.value.retry and "even alone" in never.value.message and "lower max_tokens" in never.value.message


def test_an_embedding_request_is_admitted_against_every_served_model(minilm, tiny, limit, monkeypatch):
    engine = engine_at(tiny, BucketTable(batch=(1, 2), prompt=(16, 32), capacity=(64,)))
    embedder, other = embedder_of(minilm), embedder_of(minilm)
    alone = tiny.nbytes + 2 * minilm.nbytes + memory.embedding_step_bytes(minilm, 8, 32)  # 5 inputs, the longest 20
    limit(alone)
    admit_embedding([engine], [embedder, other], embedder, [20, 5, 5, 5, 5])
    monkeypatch.setattr(engine, "load", lambda: [(10, 20)])  # a chat request running
    with pytest.raises(MemoryAdmissionError) as busy:
        admit_embedding([engine], [embedder, other], embedder, [20, 5, 5, 5, 5])
    assert busy.value.retry
    monkeypatch.setattr(engine, "load", lambda: [])
    other.submit([[1] * 200])  # the other embedding model's step
    with pytest.raises(MemoryAdmissionError):
        admit_embedding([engine], [embedder, other], embedder, [20, 5, 5, 5, 5])
    limit(alone - 1)
    with pytest.raises(MemoryAdmissionError) as never:
        admit_embedding([engine], [embedder, other], embedder, [20, 5, 5, 5, 5])
    message = never.value.message
    assert not never.value.retry and "5 inputs, the longest 20 tokens" in message and "fewer or shorter" in message


class CachingEngine(SimpleNamespace):
    """A chat engine's face to admission: its weights, load and prefix cache (evictions recorded)."""

    def shrink_prefix_cache(self, nbytes: int) -> None:
        self.evicted.append(nbytes)


def test_an_embedding_request_that_fits_without_prefix_blocks_has_them_evicted(minilm, limit, monkeypatch):
    monkeypatch.setattr(memory, "load_bytes", lambda engine, rows: engine.model.nbytes)
    engines = [
        CachingEngine(model=SimpleNamespace(nbytes=100), load=list, prefix_cache_bytes=held, evicted=[])
        for held in (30, 50)
    ]
    embedder = embedder_of(minilm)
    need = 200 + embedder_load_bytes(embedder, [10])
    limit(need + 40)  # the caches hold 80: 40 too many
    admit_embedding(engines, [embedder], embedder, [10])  # type: ignore[arg-type]
    assert [e.evicted for e in engines] == [[], [40]]  # the larger cache gives way first
    limit(need + 10)  # 70 too many: all the larger holds and 20 of the smaller
    for e in engines:
        e.evicted.clear()
    admit_embedding(engines, [embedder], embedder, [10])  # type: ignore[arg-type]
    assert [e.evicted for e in engines] == [[20], [70]]


def test_the_embeddings_route_answers_503_naming_input_over_the_memory_limit(minilm, limit):
    app = create_app(Settings.model_validate({}))  # its lifespan does not run: the embedder is put in by hand
    state = app.state.stepserve
    state.embedders["minilm"] = embedder = embedder_of(minilm, state.metrics)
    embedder.start([])
    body = {"model": "minilm", "input": ["The cat sits on the mat."] * 3}
    try:
        assert embedder.ready.wait(60)
        client = TestClient(app)
        limit(minilm.nbytes + memory.embedding_step_bytes(minilm, 8, 16))
        assert client.post("/v1/embeddings", json=body).status_code == 200
        limit(minilm.nbytes + memory.embedding_step_bytes(minilm, 8, 16) - 1)
        refused = client.post("/v1/embeddings", json=body)
    finally:
        embedder.stop()
    assert refused.status_code == 503 and "Retry-After" not in refused.headers
    error = refused.json()["error"]
    assert error["param"] == "input" and "MLX's memory limit" in error["message"]
    assert state.metrics.queue_rejections.labels("minilm", "memory")._value.get() == 1
