"""HTTP routes: thin handlers that validate, hand work to an engine and await its events."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from models.tokenizer import TokenizerError
from service.engine import Engine
from service.errors import ApiError
from service.schemas import ErrorBody, InferRequest, InferResponse, ModelCard, ModelList, Timings, Usage
from service.sequence import FinalEvent, FinishReason, SamplingParams, Sequence, TokenEvent
from service.state import AppState

router = APIRouter()
ERRORS = {code: {"model": ErrorBody} for code in (400, 404, 413, 422, 500, 503)}


def get_state(request: Request) -> AppState:
    return request.app.state.stepserve


State = Annotated[AppState, Depends(get_state)]


def resolve_engine(state: AppState, name: str | None) -> Engine:
    """The engine serving ``name`` (default model if None). 404 unknown, 503 not ready."""
    engine = state.engines.get(name or state.default_model)
    if engine is None:
        raise ApiError(404, f"model '{name}' not found; available: {', '.join(state.engines)}", type="not_found_error", param="model")
    if not engine.ready.is_set():
        raise ApiError(503, f"model '{engine.model.name}' is not ready: {engine.not_ready_reason}", type="unavailable")
    return engine


def build_sequence(engine: Engine, body: InferRequest, default_max_tokens: int, emit) -> Sequence:
    """Tokenize the request and check it fits the buckets (400 naming the limit if not)."""
    tokenizer = engine.model.tokenizer
    try:
        if body.messages is not None:
            text = tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        else:
            text = body.prompt
    except TokenizerError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    ids = tokenizer.encode(text)
    limit = engine.buckets.prompt[-1]
    if len(ids) > limit:
        raise ApiError(400, f"prompt is {len(ids)} tokens; the largest prompt bucket is {limit} tokens", param="prompt")
    max_tokens = body.max_tokens or default_max_tokens
    room = engine.capacity_limit - len(ids) + 1
    if max_tokens > room:
        raise ApiError(
            400,
            f"max_tokens {max_tokens} exceeds what fits: prompt {len(ids)} tokens + max_tokens - 1 must be "
            f"<= {engine.capacity_limit} (the largest KV capacity bucket), so max_tokens <= {room}",
            param="max_tokens",
        )
    params = SamplingParams(max_tokens, body.temperature, body.top_p, body.top_k, body.seed, tuple(body.stop))
    return Sequence(ids, params, tokenizer.detokenizer(), emit)


def thread_safe_queue() -> tuple[asyncio.Queue, callable]:
    """An asyncio queue and an ``emit`` that the engine thread may call."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    return events, lambda event: loop.call_soon_threadsafe(events.put_nowait, event)


@router.post("/infer", response_model=InferResponse, responses=ERRORS)
async def infer(body: InferRequest, state: State) -> InferResponse:
    """Generate a completion for a prompt or a chat."""
    engine = resolve_engine(state, body.model)
    events, emit = thread_safe_queue()
    seq = build_sequence(engine, body, state.settings.default_max_tokens, emit)
    engine.submit(seq)
    pieces: list[str] = []
    while True:
        event = await events.get()
        if isinstance(event, TokenEvent):
            pieces.append(event.text)
        elif isinstance(event, FinalEvent):
            break
    if event.finish_reason is FinishReason.ERROR:
        raise ApiError(500, event.error or "generation failed", type="server_error")
    return InferResponse(
        id=seq.request_id,
        model=engine.model.name,
        text="".join(pieces),
        finish_reason=event.finish_reason.value,
        usage=Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens),
        timings=Timings(queue_s=event.queue_s, ttft_s=event.ttft_s, decode_s=event.decode_s, total_s=event.total_s),
    )


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: State) -> ModelList:
    """The served models, in OpenAI's list shape."""
    return ModelList(data=[ModelCard(id=name, created=state.started) for name in state.engines])


@router.get("/healthz")
async def healthz() -> dict:
    """The process is alive (answers during warm-up and generation)."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"model": ErrorBody}})
async def readyz(state: State) -> dict:
    """200 once every model is warmed up; 503 with the reason before."""
    waiting = {name: e.not_ready_reason for name, e in state.engines.items() if not e.ready.is_set()}
    if not state.engines or waiting:
        reason = "; ".join(f"{n}: {r}" for n, r in waiting.items()) or "loading models"
        raise ApiError(503, f"not ready: {reason}", type="unavailable")
    return {
        "status": "ready",
        "models": {
            name: {"warmup_s": e.warmup_seconds, "compiled": state.compile_cache_size(), "compile": state.settings.compile}
            for name, e in state.engines.items()
        },
    }


@router.get("/metrics")
async def metrics(state: State) -> Response:
    """Prometheus text exposition."""
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
