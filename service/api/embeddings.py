"""``POST /v1/embeddings`` (OpenAI's shape): texts or token ids in, one vector each out.

An embedding model (a sentence-transformers directory, :func:`models.embedding_dir.is_embedding_model`)
is served beside the chat models by its own :class:`service.engine.embedder.Embedder`, which
batches the inputs of concurrent requests into compiled (batch, length) buckets. Errors name
the field: ``model`` (unknown: 404; a chat model: 400), ``input`` (longer than the model's
``max_seq_length``, or a token id outside its vocabulary: 400; inputs are never truncated, as
OpenAI's API), ``dimensions`` (anything but the model's own dimension: 400). A request that could
take the served models past MLX's memory limit answers 503 naming ``input``
(:func:`service.process.memory.admit_embedding`; with ``Retry-After`` when it would fit on an
idle server). A request held by
an embedder whose thread died or is stuck in a step answers 500 naming the failure (the watchdog
then restarts the server, :mod:`service.process.watchdog`).
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import APIRouter

from service.api.errors import ERRORS, ApiError
from service.api.schemas import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from service.api.state import AppState, State
from service.engine.embedder import Embedder, EmbedderFailed, EmbedderStopped
from service.process import memory

router = APIRouter(prefix="/v1")


def _embedder(state: AppState, name: str | None) -> Embedder:
    """The embedder serving ``name`` (the first embedding model if None): 404 unknown, 400 a
    chat model, 503 not ready or draining."""
    embedder = state.embedders.get(name) if name else next(iter(state.embedders.values()), None)
    if embedder is None:
        served = ", ".join(state.embedders) or "none"
        if name in state.engines:
            raise ApiError(
                400,
                f"model '{name}' is a chat model; /v1/embeddings serves embedding models (served: {served})",
                param="model",
            )
        raise ApiError(
            404,
            f"embedding model '{name}' not found; embedding models: {served}",
            type="not_found_error",
            param="model",
        )
    if state.draining:
        raise ApiError(503, "server is shutting down", type="unavailable")
    if not embedder.ready.is_set():
        raise ApiError(
            503, f"model '{embedder.model.name}' is not ready: {embedder.not_ready_reason}", type="unavailable"
        )
    return embedder


def _token_ids(embedder: Embedder, inputs: list[str | list[int]]) -> list[list[int]]:
    """Each input's token ids (texts tokenized with [CLS] and [SEP]); 400 naming ``input`` for
    one past the model's longest input or with an id outside its vocabulary."""
    model = embedder.model
    texts = [i for i in inputs if isinstance(i, str)]
    encoded = iter(model.tokenize(texts) if texts else [])
    rows = [next(encoded) if isinstance(i, str) else i for i in inputs]
    for index, ids in enumerate(rows):
        if len(ids) > embedder.max_tokens:
            raise ApiError(
                400,
                f"input {index} has {len(ids)} tokens, more than the model's maximum of {embedder.max_tokens}; "
                "shorten it or split it (inputs are not truncated)",
                param="input",
            )
        if min(ids) < 0 or max(ids) >= model.args.vocab_size:
            raise ApiError(400, f"input {index} has a token id outside 0..{model.args.vocab_size - 1}", param="input")
    return rows


def _admit_memory(state: AppState, embedder: Embedder, rows: list[list[int]]) -> None:
    """503 naming ``input`` when the request could take MLX past its memory limit
    (:func:`service.process.memory.admit_embedding`), with ``Retry-After`` when it would fit on
    an idle server."""
    try:
        memory.admit_embedding(state.engines.values(), state.embedders.values(), embedder, [len(r) for r in rows])
    except memory.MemoryAdmissionError as exc:
        state.metrics.queue_rejections.labels(embedder.model.name, "memory").inc()
        retry = {"Retry-After": "1"} if exc.retry else None
        raise ApiError(503, exc.message, type="unavailable", param="input", headers=retry) from exc


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as floats, or as base64 of its little-endian float32 bytes (OpenAI's ``base64``)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@router.post("/embeddings", response_model=EmbeddingResponse, responses=ERRORS)
async def embeddings(body: EmbeddingRequest, state: State) -> EmbeddingResponse:
    """Embed each input with an embedding model: ``data[i].embedding`` is input ``i``'s vector
    (pooled and normalized as the model's sentence-transformers modules say); ``usage`` counts
    the input tokens."""
    embedder = _embedder(state, body.model)
    if body.dimensions is not None and body.dimensions != embedder.model.dimensions:
        raise ApiError(
            400,
            f"model '{embedder.model.name}' makes {embedder.model.dimensions}-dimensional embeddings and cannot "
            f"shorten them (it is not trained for it); leave dimensions unset or set {embedder.model.dimensions}",
            param="dimensions",
        )
    rows = _token_ids(embedder, body.inputs)
    _admit_memory(state, embedder, rows)
    try:
        vectors = await asyncio.wrap_future(embedder.submit(rows))
    except EmbedderStopped as exc:
        raise ApiError(503, str(exc), type="unavailable") from exc
    except EmbedderFailed as exc:  # its thread died: the watchdog restarts the server
        raise ApiError(500, str(exc), type="server_error") from exc
    tokens = sum(map(len, rows))
    return EmbeddingResponse(
        data=[Embedding(index=i, embedding=_encode(v, body.encoding_format)) for i, v in enumerate(vectors)],
        model=embedder.model.name,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
