"""``stepserve bench embeddings``: texts/s of the embedding engine in-process, per batch size,
against sentence-transformers on the same texts and threads when it is installed.

stepserve's figure is the served path without HTTP: tokenize, hand the batch to a running
:class:`service.engine.embedder.Embedder` (compiled per (batch, length) bucket, warmed before
timing) and wait for the vectors. sentence-transformers' is ``SentenceTransformer.encode(texts,
batch_size=B)`` (tokenize, forward, pool, normalize), measured afterwards in a child process (torch
loaded beside MLX slowed MLX about tenfold on a 2-core CPU). Each figure is the median of
``--rounds`` rounds of ``max(B, --texts)`` texts cut into batches of B.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.table import Table

from service.bench.common import report

_WORDS = (
    "the model compiles each bucket once and serves requests in batches while a cat sleeps on a warm "
    "mat near the window and markets open on Monday with news of rain across the northern hills"
).split()


def texts(n: int, seed: int = 0) -> list[str]:
    """``n`` deterministic sentences of 6 to 40 words (8 to ~50 tokens with [CLS] and [SEP])."""
    out = []
    for i in range(n):
        length = 6 + (i * 7 + seed) % 35
        out.append(" ".join(_WORDS[(i * 3 + j * 5 + seed) % len(_WORDS)] for j in range(length)) + ".")
    return out


def _stepserve(model_dir: Path, batches: list[int]):
    """A started embedder for all-MiniLM-L6-v2 with batch buckets ``batches``, warmed for them."""
    from prometheus_client import CollectorRegistry

    from models.loader import device_name
    from models.sentence import load_embedding_model
    from service import __version__
    from service.engine.compile_cache import CompileCache
    from service.engine.embedder import Embedder, length_buckets
    from service.metrics import Metrics
    from service.process.startup import compute_dtype

    model = load_embedding_model(model_dir, "bench", compute_dtype("auto"))
    metrics = Metrics(CollectorRegistry(), version=__version__, device=device_name())
    cache = CompileCache("on", metrics.record_lookup, metrics.record_compile)
    embedder = Embedder(model, tuple(batches), length_buckets([16, 32, 64], model.max_tokens), cache, metrics)
    embedder.start([(b, t) for b in batches for t in embedder.lengths[:3]])  # the texts' lengths: up to 64
    embedder.ready.wait()
    return embedder


def _rate(run, batches: list[list[str]]) -> float:
    """Texts per second of ``run`` over ``batches``, one call per batch."""
    start = time.perf_counter()
    for chunk in batches:
        run(chunk)
    return sum(map(len, batches)) / (time.perf_counter() - start)


def _rates(run, batches: list[int], n: int, rounds: int) -> dict[int, float]:
    """Per batch size B: the median over ``rounds`` of :func:`_rate` on ``max(B, n)`` texts cut
    into batches of B, after one untimed batch."""
    out = {}
    for b in batches:
        corpus = texts(max(b, n))
        chunks = [corpus[i : i + b] for i in range(0, len(corpus), b)]
        _rate(run, chunks[:1])
        out[b] = statistics.median(_rate(run, chunks) for _ in range(rounds))
    return out


def sentence_transformers_rates(
    model_dir: str, batches: list[int], n: int, rounds: int, device: str = "cpu"
) -> dict[int, float]:
    """:func:`_rates` of ``SentenceTransformer.encode(texts, batch_size=B)`` on torch's
    ``device`` (``cpu``, ``cuda``, ``mps``), run in a child process (torch loaded beside MLX's
    OpenBLAS slowed MLX's matmuls about tenfold here)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device=device)
    return _rates(lambda c: model.encode(c, batch_size=len(c)), batches, n, rounds)  # one batch per call


def main(argv: list[str]) -> int:
    """Parse the flags, measure each batch size with stepserve (and sentence-transformers), report."""
    parser = argparse.ArgumentParser(prog="stepserve bench embeddings", description=__doc__)
    parser.add_argument("--model", type=Path, help="embedding model directory; unset: the packaged all-MiniLM-L6-v2")
    parser.add_argument("--batches", default="1,32,256", help="batch sizes (comma-separated)")
    parser.add_argument("--texts", type=int, default=256, help="texts per round at least (default 256)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per figure; the median is kept")
    parser.add_argument(
        "--peer-device", default="cpu", help="torch device of sentence-transformers: cpu (default), cuda or mps"
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    batches = sorted(int(b) for b in args.batches.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        from models.embedding_dir import packaged_minilm

        model_dir = args.model or packaged_minilm(Path(tmp))
        embedder = _stepserve(model_dir, batches)
        try:
            ours = _rates(
                lambda c: embedder.submit(embedder.model.tokenize(c)).result(), batches, args.texts, args.rounds
            )
        finally:
            embedder.stop()
        theirs: dict[int, float] = {}
        if importlib.util.find_spec("sentence_transformers") is not None:
            spawn = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                job = pool.submit(
                    sentence_transformers_rates, str(model_dir), batches, args.texts, args.rounds, args.peer_device
                )
                theirs = job.result()
    rows, table = [], Table("batch", "stepserve texts/s", "sentence-transformers texts/s", "ratio")
    for b in batches:
        row = {"batch": b, "stepserve_texts_per_s": ours[b]}
        if b in theirs:
            row |= {"sentence_transformers_texts_per_s": theirs[b], "ratio": ours[b] / theirs[b]}
        rows.append(row)
        ref = f"{theirs[b]:.1f}" if b in theirs else "-"
        table.add_row(str(b), f"{ours[b]:.1f}", ref, f"{ours[b] / theirs[b]:.2f}x" if b in theirs else "-")
    result = {
        "model": model_dir.name,
        "texts_per_round": args.texts,
        "rounds": args.rounds,
        "peer_device": args.peer_device,
        "results": rows,
    }
    return report(result, ["embeddings", *argv], [table], args.out)
