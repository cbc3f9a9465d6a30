"""The embedding engine on the real all-MiniLM-L6-v2: a padded, compiled batch gives each input
the vector it gets alone, and concurrent requests share steps."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from models.embedding_dir import packaged_minilm
from models.errors import ModelLoadError
from models.sentence import load_embedding_model
from service.engine.compile_cache import CompileCache
from service.engine.embedder import Embedder, length_buckets
from service.metrics import Metrics

TEXTS = ["a", "The cat sits on the mat.", "Stock markets fell sharply on Tuesday after a long rally in tech."]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_embedding_model(packaged_minilm(tmp_path_factory.mktemp("minilm")), "minilm", mx.float32)


def test_model_reads_its_sentence_transformers_modules(model):
    assert (model.pooling, model.normalize, model.max_tokens, model.dimensions) == ("mean", True, 256, 384)
    assert model.tokenize(["hello world"])[0] == [101, 7592, 2088, 102]  # [CLS] hello world [SEP], unpadded


def test_padded_compiled_batch_matches_each_input_alone(model):
    ids = model.tokenize(TEXTS)
    batch, length = 4, 32  # one padding row, padding columns
    padded, mask = np.zeros((batch, length), np.int32), np.zeros((batch, length), np.int32)
    mask[len(ids) :, 0] = 1
    for r, row in enumerate(ids):
        padded[r, : len(row)], mask[r, : len(row)] = row, 1
    together = mx.compile(model.embed)(mx.array(padded), mx.array(mask))
    for r, row in enumerate(ids):
        alone = model.embed(mx.array([row]), mx.ones((1, len(row)), mx.int32))
        assert mx.allclose(together[r], alone[0], atol=1e-5)


def test_concurrent_requests_share_steps(model):
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    cache = CompileCache("on", metrics.record_lookup, metrics.record_compile)
    embedder = Embedder(model, (1, 4, 16), length_buckets([16, 32], model.max_tokens), cache, metrics)
    assert embedder.lengths == (16, 32, 256)
    embedder.start([(b, t) for b in (1, 4, 16) for t in (16, 32)])
    try:
        assert embedder.ready.wait(120)
        rows = model.tokenize([f"sentence {i}: {TEXTS[i % 3]}" for i in range(16)])
        with ThreadPoolExecutor(16) as pool:
            futures = list(pool.map(lambda r: embedder.submit([r]), rows))
        got = np.concatenate([f.result(60) for f in futures])
        alone = np.array(embedder.submit(rows[:1]).result(60))
    finally:
        embedder.stop()
    assert np.allclose(got[0], alone[0], atol=1e-5)
    steps = metrics.embedding_steps.labels("minilm")._value.get()
    assert metrics.embedding_requests.labels("minilm")._value.get() == 17 and steps < 17


def test_the_warm_up_compiles_on_a_thread_of_its_own_and_steps_run_on_the_embedders(model):
    """Warm-up's allocations stay off the serving thread's malloc arena (service.engine.threads):
    the buckets compile on another thread, ended before ready; requests step on the embedder's."""
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    cache = CompileCache("on", metrics.record_lookup, metrics.record_compile)
    embedder = Embedder(model, (1,), length_buckets([16], model.max_tokens), cache, metrics)
    seen: dict[str, threading.Thread] = {}
    fn, step = embedder._fn, embedder.step

    def recording_fn(batch, length):
        seen.setdefault("warm-up", threading.current_thread())
        return fn(batch, length)

    def recording_step():
        seen["step"] = threading.current_thread()
        embedder._fn = fn
        return step()

    embedder._fn, embedder.step = recording_fn, recording_step
    embedder.start([(1, 16)])
    try:
        assert embedder.ready.wait(120)
        assert len(embedder.submit(model.tokenize(["hello"])).result(60)[0]) == model.dimensions
    finally:
        embedder.stop()
    assert seen["step"] is embedder._thread
    assert seen["warm-up"] is not embedder._thread and not seen["warm-up"].is_alive()


def test_a_decoder_directory_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    (tmp_path / "modules.json").write_text("[]")
    with pytest.raises(ModelLoadError, match="model_type 'qwen3' is not implemented for embeddings"):
        load_embedding_model(tmp_path, "x", mx.float32)
