"""From a validated request to events and back: tokenize, check the buckets, submit to the
engine, and either collect the whole text or stream server-sent events. Shared by
``/infer`` and the OpenAI-compatible routes, which differ only in their JSON shapes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from models.tokenizer import TokenizerError
from service.api import security
from service.api.errors import ApiError
from service.api.state import AppState
from service.engine.buckets import BucketLimitError
from service.engine.core import Engine
from service.engine.scheduler import DrainingError, QueueFullError
from service.engine.sequence import Event, FinalEvent, FinishReason, SamplingParams, Sequence
from service.process import watchdog as faults

DISCONNECT_POLL_S = 0.25
CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer


class ResponseFormat(Protocol):
    """How one route shapes its answers."""

    done_marker: bool  # end a stream with ``data: [DONE]`` (OpenAI)

    def chunks(self, text: str) -> list[dict]: ...
    def final_chunks(self, final: FinalEvent) -> list[dict]: ...
    def body(self, text: str, final: FinalEvent) -> dict: ...


def resolve_engine(state: AppState, name: str | None) -> Engine:
    """The engine serving ``name`` (default model if None). 404 unknown, 503 not ready/draining."""
    engine = state.engines.get(name or state.default_model)
    if engine is None:
        raise ApiError(
            404,
            f"model '{name}' not found; available: {', '.join(state.engines)}",
            type="not_found_error",
            param="model",
        )
    if state.draining:
        raise ApiError(503, "server is shutting down", type="unavailable")
    if not engine.ready.is_set():
        raise ApiError(503, f"model '{engine.model.name}' is not ready: {engine.not_ready_reason}", type="unavailable")
    return engine


def prompt_ids(engine: Engine, prompt: str | None, messages: list[dict] | None) -> list[int]:
    """Token ids of a raw prompt or of chat messages rendered by the chat template.

    Raises ApiError 400 when the template fails or the prompt exceeds the largest bucket.
    """
    tokenizer = engine.model.tokenizer
    try:
        text = tokenizer.apply_chat_template(messages) if messages is not None else prompt
    except TokenizerError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    security.check_prompt_chars(tokenizer, text, engine.buckets.prompt[-1])
    ids = tokenizer.encode(text)
    if not ids:
        raise ApiError(400, "prompt encodes to no tokens", param="prompt")
    try:
        engine.buckets.prompt_for(len(ids))
    except BucketLimitError as exc:
        raise ApiError(400, f"prompt is {len(ids)} tokens: {exc}", param="prompt") from exc
    return ids


def sampling_params(engine: Engine, n_prompt: int, max_tokens: int, **sampling) -> SamplingParams:
    """Check that ``max_tokens`` fits the largest KV capacity bucket (400 naming it)."""
    room = engine.capacity_limit - n_prompt + 1
    if max_tokens > room:
        raise ApiError(
            400,
            f"max_tokens {max_tokens} exceeds what fits: prompt {n_prompt} tokens + max_tokens - 1 must be "
            f"<= {engine.capacity_limit} (the largest KV capacity bucket), so max_tokens <= {room}",
            param="max_tokens",
        )
    return SamplingParams(max_tokens=max_tokens, **sampling)


def start(state: AppState, engine: Engine, ids: list[int], params: SamplingParams) -> tuple[Sequence, asyncio.Queue]:
    """Submit a request; its events arrive on the returned queue. 429 when the queue is full,
    503 when it could take MLX past its memory limit (:func:`service.faults.admit_memory`)."""
    faults.admit_memory(state, engine, len(ids), params.max_tokens)
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    seq = Sequence(
        ids, params, engine.model.tokenizer.detokenizer(), lambda e: loop.call_soon_threadsafe(events.put_nowait, e)
    )
    seq.deadline = seq.arrival + state.settings.request_timeout_s
    try:
        engine.submit(seq)
    except QueueFullError as exc:
        state.metrics.queue_rejections.labels(engine.model.name, "queue_full").inc()
        raise ApiError(429, f"{exc}; retry later", type="rate_limit_error", headers={"Retry-After": "1"}) from exc
    except DrainingError as exc:
        state.metrics.queue_rejections.labels(engine.model.name, "draining").inc()
        raise ApiError(503, str(exc), type="unavailable") from exc
    return seq, events


async def next_event(request: Request, engine: Engine, seq: Sequence, events: asyncio.Queue) -> Event | None:
    """The next event, or None when the client disconnected (the request is then cancelled)."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                engine.cancel(seq)
                return None


def _failure(final: FinalEvent) -> ApiError | None:
    """The HTTP error for a request that ended before producing anything, else None."""
    if final.finish_reason is FinishReason.ERROR:
        return ApiError(500, final.error or "generation failed", type="server_error")
    if final.completion_tokens == 0 and final.finish_reason is FinishReason.TIMEOUT:
        return ApiError(504, "request timed out before its first token", type="timeout")
    if final.completion_tokens == 0 and final.finish_reason is FinishReason.CANCELLED:
        return ApiError(503, final.error or "request cancelled", type="unavailable")
    return None


async def respond(
    request: Request, engine: Engine, seq: Sequence, events: asyncio.Queue, fmt: ResponseFormat, stream: bool
):
    """Answer with the whole text (JSON) or a server-sent event stream in ``fmt``'s shape."""
    first = await next_event(request, engine, seq, events)
    if first is None:
        return JSONResponse({"error": {"message": "client closed request"}}, status_code=CLIENT_CLOSED)
    if isinstance(first, FinalEvent) and (error := _failure(first)):
        raise error
    if stream:
        return StreamingResponse(
            _sse(request, engine, seq, events, fmt, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    pieces, event = [], first
    while not isinstance(event, FinalEvent):
        pieces.append(event.text)
        event = await next_event(request, engine, seq, events)
        if event is None:
            return JSONResponse({"error": {"message": "client closed request"}}, status_code=CLIENT_CLOSED)
    if error := _failure(event):
        raise error
    return fmt.body("".join(pieces), event)


async def _sse(request, engine, seq, events, fmt: ResponseFormat, first: Event) -> AsyncIterator[str]:
    """Server-sent events; a client that goes away cancels the request."""
    finished = False
    try:
        event = first
        while True:
            for chunk in fmt.final_chunks(event) if isinstance(event, FinalEvent) else fmt.chunks(event.text):
                yield f"data: {json.dumps(chunk)}\n\n"
            if isinstance(event, FinalEvent):
                finished = True
                break
            event = await events.get()
        if fmt.done_marker:
            yield "data: [DONE]\n\n"
    finally:
        if not finished:
            engine.cancel(seq)


def timings(final: FinalEvent) -> dict:
    return {"queue_s": final.queue_s, "ttft_s": final.ttft_s, "decode_s": final.decode_s, "total_s": final.total_s}
