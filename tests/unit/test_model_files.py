"""Damaged model files are refused before MLX reads them, and the memory estimate follows the load (no server)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from models.default import default_model_path
from models.errors import ModelLoadError
from models.gguf.header import GGUFLayoutError, check_gguf_layout
from models.hf import tokenizer_from_dir
from models.loader import LoadedModel
from service.engine.buckets import BucketTable
from service.engine.scheduler import Scheduler
from service.process.memory import load_bytes as engine_bytes
from tests.support import TINY, damaged, random_params


@pytest.fixture(scope="module")
def gguf_bytes() -> bytes:
    return default_model_path().read_bytes()


@pytest.mark.parametrize("kind", ["key-length", "tensor-count", "value-type", "not-gguf"])
def test_damaged_gguf_layout_is_refused_before_mlx_reads_it(tmp_path, gguf_bytes, kind):
    path = tmp_path / "model.gguf"
    path.write_bytes(damaged(gguf_bytes[:3_000_000], kind))
    with pytest.raises(GGUFLayoutError):
        check_gguf_layout(path)


def test_intact_gguf_layout_passes():
    check_gguf_layout(default_model_path())


@pytest.mark.parametrize("content", ["{}", "{oops", ""])
def test_corrupt_tokenizer_json_names_the_file(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ModelLoadError, match=str(tmp_path / "tokenizer.json")):
        tokenizer_from_dir(tmp_path, {})


# -- a request over MLX's memory limit, slow and endless bodies -------------------------------------


def test_memory_estimate_follows_the_load():
    # An engine's parts the estimate reads: a tiny model (2 layers, 2 KV heads of 16, float32:
    # 512 bytes per position), its buckets and its scheduler.
    model = LoadedModel("tiny", Path("-"), TINY, random_params(), None, mx.float32, "dequantized", 0.0)
    engine = SimpleNamespace(
        model=model,
        buckets=BucketTable((1, 2, 4), (16, 32), (64, 128)),
        scheduler=Scheduler(max_running=4, max_waiting=8, chunk_tokens=64, max_batched_tokens=32),
        executor=SimpleNamespace(batches_chunks=False, pool=None, in_blocks=False),  # chunks one by one; no pool
    )
    per_position, scores = 512, 4 * 4  # 4 query heads of float32 scores per (query, key) pair
    weights = model.nbytes
    assert engine_bytes(engine, []) == weights
    alone = engine_bytes(engine, [(10, 20)])  # batch 1, capacity 64, prompt bucket 16
    assert alone == weights + 2 * 64 * per_position + 16 * (per_position + 16 * scores)
    three = engine_bytes(engine, [(10, 20), (30, 20), (10, 90)])  # batch 4, capacity 128, prefill 1 x 32
    assert three == weights + 2 * 4 * 128 * per_position + 1 * 32 * (per_position + 32 * scores)  # a call: one chunk
    assert engine_bytes(engine, [(10, 20)] * 9) == engine_bytes(engine, [(10, 20)] * 4)  # waiting rows add no slots
