"""The one request pipeline of ``/infer``, the Anthropic Messages routes and OpenAI's
Responses route, which differ only in their :class:`ResponseFormat`:

route → :func:`resolve_engine`, :func:`prompt_ids`, :func:`sampling_params` (checks, 4xx/503)
→ :func:`start` (memory admission, ``Engine.submit``) → :func:`respond` (the engine's events,
awaited under the request's deadline, answered as one JSON body or as server-sent events).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from models.tokenizer import TokenizerError
from service.api import security
from service.api.errors import ApiError, Shape, client_closed
from service.api.events import EventSink, Generation
from service.api.reasoning import AnswerPlan, prompt_opens_thinking
from service.api.rehearsal import REHEARSAL
from service.api.state import AppState
from service.api.tools import render_messages
from service.engine.core import Engine
from service.engine.grammar import Grammar, GrammarError
from service.engine.scheduler import DrainingError, QueueFullError
from service.engine.sequence import Event, FinalEvent, FinishReason, SamplingParams, Sequence, TokenEvent
from service.process import memory
from service.process.on_demand import ModelLoadFailed, ModelLoading

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ResponseFormat(Protocol):
    """How one route shapes its answers (dicts, serialized as JSON)."""

    done_marker: bool  # end a stream with ``data: [DONE]`` (OpenAI)
    # The API whose error bodies it speaks: "openai" or "anthropic" (Anthropic's error shape).
    shape: Shape
    # Each stream event's ``type`` also on an ``event:`` line (Anthropic's Messages, OpenAI's
    # Responses); else ``data:`` lines only (chat completions, /infer).
    named_events: bool
    # A request that produced tokens before its time limit or a shutdown ended it: True, it
    # answers normally with finish_reason timeout/cancelled (/infer); False, it answers as an
    # error, 504 or 503 (OpenAI, whose finish_reason is only stop or length).
    partial_ends: bool

    # A token event's text as events; ``tokens``: the output tokens through it (cumulative).
    def chunks(self, text: str, logprobs: tuple = (), tokens: int | None = None) -> list[dict]: ...
    def add(self, event: TokenEvent) -> None: ...  # a token event of an answer that is not streamed
    def final_chunks(self, final: FinalEvent) -> list[dict]: ...
    def body(self, text: str, final: FinalEvent) -> dict: ...
    def error_chunks(self, error: ApiError) -> list[dict]: ...  # the events that end a failed stream


async def resolve_engine(state: AppState, name: str | None) -> Engine:
    """The engine serving ``name`` (default model if None). 404 unknown, 503 not ready/draining.
    An on-demand model not loaded is loaded first (:meth:`OnDemandModels.engine`): the request
    waits for it, or is answered 503 with ``Retry-After`` (``on_demand_wait = "503"``); 503 when
    its load failed."""
    name = name or state.default_model
    if name in state.embedders:
        raise ApiError(
            400,
            f"model '{name}' is an embedding model: it answers POST /v1/embeddings only; "
            f"chat models: {', '.join(n for n in state.model_names if n not in state.embedders) or 'none'}",
            param="model",
        )
    if name not in state.model_names:
        raise ApiError(
            404,
            f"model '{name}' not found; available: {', '.join(state.model_names)}",
            type="not_found_error",
            param="model",
        )
    if state.draining:
        raise ApiError(503, "server is shutting down", type="unavailable")
    if name in state.on_demand and not REHEARSAL.get():  # (its warm-up's own requests come before it is loaded)
        try:
            return await state.on_demand.engine(name)
        except ModelLoading as exc:
            raise ApiError(503, str(exc), type="unavailable", headers={"Retry-After": str(exc.retry_after_s)}) from exc
        except ModelLoadFailed as exc:
            raise ApiError(503, str(exc), type="unavailable") from exc
    engine = state.engines[name]
    if not engine.ready.is_set() and not REHEARSAL.get():  # (the app's own warm-up requests come before ready)
        raise ApiError(503, f"model '{engine.model.name}' is not ready: {engine.not_ready_reason}", type="unavailable")
    return engine


def check_messages(messages: list) -> None:
    """400 naming the first content part that is not text (``messages.i.content.j.type``)."""
    for i, message in enumerate(messages):
        if (bad := message.unsupported_part()) is not None:
            j, kind = bad
            raise ApiError(
                400,
                f"content parts of type '{kind}' are not supported; only text",
                param=f"messages.{i}.content.{j}.type",
            )


TOKENIZE_IN_THREAD_CHARS = 16384  # longer texts are tokenized on a worker thread (see prompt_ids)


async def prompt_ids(
    engine: Engine,
    prompt: str | list[int] | None,
    messages: list[dict] | None,
    tools: list[dict] | None = None,
    param: str = "prompt",
    variables: dict | None = None,
) -> list[int]:
    """Token ids of a raw prompt (text or token ids) or of chat messages rendered by the chat
    template (with ``tools`` and the further template ``variables`` passed to it).

    A text of more than ``TOKENIZE_IN_THREAD_CHARS`` characters is tokenized on a worker
    thread (``tokenizers`` releases the GIL while it encodes), so a long retrieval-augmented
    prompt does not hold every stream's events on the event loop while it is tokenized. Shorter
    ones (a few milliseconds at most) are tokenized at once: the trip to a worker thread and
    back costs two GIL hand-offs, each up to the switch interval (``switch_interval_s``) when
    the engine thread is busy in Python.

    Raises ApiError 400 when the template fails, a token id is outside the vocabulary, or the
    prompt exceeds the largest capacity bucket.
    """
    tokenizer = engine.model.tokenizer
    if isinstance(prompt, list):
        vocab = engine.model.args.vocab_size
        if bad := [t for t in prompt if not 0 <= t < vocab]:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param)
        ids = list(prompt)
    else:
        try:
            text = render_messages(tokenizer, messages, tools, variables) if messages is not None else prompt
        except TokenizerError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        assert text is not None  # the schemas require a prompt or messages
        security.check_prompt_chars(tokenizer, text, engine.capacity_limit)
        ids = (
            await asyncio.to_thread(tokenizer.encode, text)
            if len(text) > TOKENIZE_IN_THREAD_CHARS
            else tokenizer.encode(text)
        )
    if not ids:
        raise ApiError(400, "prompt encodes to no tokens", param=param)
    if len(ids) > engine.capacity_limit:
        raise ApiError(
            400,
            f"prompt is {len(ids)} tokens, over this server's context limit of {engine.capacity_limit} tokens (its "
            f"largest KV capacity bucket; the model's max_position_embeddings is "
            f"{getattr(engine.model.args, 'max_position_embeddings', None) or 'not given'})",
            param=param,
        )
    return ids


def answer_plan(state: AppState, engine: Engine, form, ids: list[int]) -> AnswerPlan:
    """How the answer to the prompt ``ids`` is read: the model's reasoning parser, the tool
    call ``form`` (:class:`service.api.tools.ToolPlan`'s) and whether the prompt's last tokens
    opened ``<think>`` (the template's generation prompt: DeepSeek-R1's, a forced prefix)."""
    parser = state.reasoning_of(engine)
    tail = engine.model.tokenizer.decode(ids[-32:]) if parser == "think" else ""
    return AnswerPlan(parser, form, prompt_opens_thinking(tail))


def sampling_params(
    engine: Engine, n_prompt: int, max_tokens: int, *, param: str = "max_tokens", **sampling
) -> SamplingParams:
    """Check that ``max_tokens`` fits the largest KV capacity bucket (400 naming ``param``, the
    route's name for it)."""
    room = engine.capacity_limit - n_prompt + 1
    if max_tokens > room:
        raise ApiError(
            400,
            f"{param} {max_tokens} exceeds what fits: prompt {n_prompt} tokens + {param} - 1 must be "
            f"<= {engine.capacity_limit} (the largest KV capacity bucket), so {param} <= {room}",
            param=param,
        )
    return SamplingParams(max_tokens=max_tokens, **sampling)


def grammar(engine: Engine, response_format, lark: str | None = None, param: str = "response_format") -> Grammar | None:
    """The compiled grammar of a ``response_format`` (:class:`service.api.schemas.ResponseFormat`)
    or of a Lark grammar (tool calls), for this engine's tokenizer; None for free text.

    Raises ApiError 400 naming ``param`` when the grammar engine cannot compile it.
    """
    kind = None if response_format is None else response_format.type
    if lark is None and kind in (None, "text"):
        return None
    try:
        compiler = engine.grammars
        if lark is not None:
            return compiler.lark(lark)
        if kind == "json_object":
            return compiler.json_object()
        spec = response_format.json_schema  # type: ignore[union-attr]  # kind is json_schema here
        return compiler.json_schema(spec.schema_, strict=bool(spec.strict))
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from exc


def start(
    state: AppState, engine: Engine, ids: list[int], params: SamplingParams, keep_special: bool = False
) -> Generation:
    """Admit and submit a request; its events arrive on the returned generation's queue.
    ``keep_special``: the text keeps special tokens (:attr:`service.api.reasoning.AnswerPlan.keep_special`).

    Raises ApiError: 503 when it could take MLX past its memory limit
    (:func:`service.process.memory.admit`; with ``Retry-After`` when it would fit on an idle
    server), 429 when the waiting queue is full, 503 while draining.
    """
    _admit_memory(state, engine, len(ids), params.max_tokens)
    events: asyncio.Queue[Event] = asyncio.Queue()
    emit = partial(EventSink.of(asyncio.get_running_loop()).put, events)  # called on the engine thread
    seq = Sequence(ids, params, engine.model.tokenizer.detokenizer(keep_special), emit)
    seq.warmup = REHEARSAL.get()
    timeout_s = state.settings.request_timeout_s
    seq.deadline = deadline = seq.arrival + timeout_s
    try:
        engine.submit(seq)
    except QueueFullError as exc:
        state.metrics.queue_rejections.labels(engine.model.name, "queue_full").inc()
        raise ApiError(429, f"{exc}; retry later", type="rate_limit_error", headers={"Retry-After": "1"}) from exc
    except DrainingError as exc:
        state.metrics.queue_rejections.labels(engine.model.name, "draining").inc()
        raise ApiError(503, str(exc), type="unavailable") from exc
    gen = Generation(engine, seq, events, timeout_s, deadline)
    gen.arm()
    return gen


def _admit_memory(state: AppState, engine: Engine, prompt_tokens: int, max_tokens: int) -> None:
    try:
        memory.admit(state.engines.values(), engine, prompt_tokens, max_tokens, state.embedders.values())
    except memory.MemoryAdmissionError as exc:
        state.metrics.queue_rejections.labels(engine.model.name, "memory").inc()
        retry = {"Retry-After": "1"} if exc.retry else None
        raise ApiError(503, exc.message, type="unavailable", param="max_tokens", headers=retry) from exc


def failure(final: FinalEvent, partial_ends: bool) -> ApiError | None:
    """The error a request's end answers as, else None (see :attr:`ResponseFormat.partial_ends`):
    500 for an engine failure; 504 for a timeout and 503 for a shutdown, when nothing was
    generated or the route has no partial ends."""
    reason, message = final.finish_reason, final.error
    if reason is FinishReason.ERROR:
        return ApiError(500, message or "generation failed", type="server_error")
    if reason not in (FinishReason.TIMEOUT, FinishReason.CANCELLED) or (partial_ends and final.completion_tokens):
        return None
    if reason is FinishReason.TIMEOUT:
        n = final.completion_tokens
        when = f"with {n} tokens generated" if n else "before its first token"
        return ApiError(504, f"{message} {when}", type="timeout")
    return ApiError(503, message or "request cancelled", type="unavailable")


async def respond(request: Request, gen: Generation, fmt: ResponseFormat, stream: bool):
    """Answer with the whole text (JSON) or a server-sent event stream in ``fmt``'s shape.

    An error before the first event is the HTTP status (:func:`failure`); once a stream has
    started, it ends with ``fmt``'s error events (then ``[DONE]`` where ``fmt`` uses it).
    """
    first = await gen.next_or_gone(request)
    if first is None:
        return client_closed()
    if isinstance(first, FinalEvent) and (error := failure(first, fmt.partial_ends)):
        raise error
    if stream:
        gen.unwatch()
        return StreamingResponse(_sse(gen, fmt, first), media_type="text/event-stream", headers=_SSE_HEADERS)
    return await _collect(request, gen, fmt, first)


async def _collect(request: Request, gen: Generation, fmt: ResponseFormat, first: Event) -> JSONResponse | dict:
    pieces, event = [], first
    while not isinstance(event, FinalEvent):
        pieces.append(event.text)
        fmt.add(event)
        event = await gen.next_or_gone(request)
        if event is None:
            return client_closed()
    if error := failure(event, fmt.partial_ends):
        raise error
    return fmt.body("".join(pieces), event)


def _data(payload: dict, named: bool = False) -> str:
    """One server-sent event; ``named``: its ``type`` also on an ``event:`` line."""
    head = f"event: {payload['type']}\n" if named else ""
    return f"{head}data: {json.dumps(payload)}\n\n"


async def _sse(gen: Generation, fmt: ResponseFormat, first: Event) -> AsyncIterator[str]:
    """Server-sent events; a client that goes away cancels the request."""
    finished = False
    try:
        event = first
        while not isinstance(event, FinalEvent):
            # The events already queued go out in one write (a client or a loop behind the engine);
            # a disconnect ends this generator while it awaits (Starlette cancels it).
            batch = [event, *gen.ready()]
            chunks = [c for e in batch if isinstance(e, TokenEvent) for c in fmt.chunks(e.text, e.logprobs, e.tokens)]
            yield "".join(_data(c, fmt.named_events) for c in chunks)
            event = batch[-1] if isinstance(batch[-1], FinalEvent) else await gen.next()
        finished = True
        error = failure(event, fmt.partial_ends)
        for chunk in fmt.error_chunks(error) if error else fmt.final_chunks(event):
            yield _data(chunk, fmt.named_events)
        if fmt.done_marker:
            yield "data: [DONE]\n\n"
    finally:
        if not finished:
            gen.cancel()
