"""OpenAI-compatible routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``,
streaming and not, in the JSON shapes of OpenAI's API (so its SDKs work unchanged).

Each prompt (a list of prompts on ``/v1/completions``) gets ``n`` choices, each its own row of
the engine's batch; choice ``i`` of a seeded request samples with ``seed + i``. ``choices[k]``
is choice ``k % n`` of prompt ``k // n``.

``finish_reason`` is ``stop``, ``length`` or ``tool_calls``. A request ended early answers as
an error in OpenAI's shape (:mod:`service.api.errors`): 504 (``type`` ``timeout``) past
``request_timeout_s``, 503 (``unavailable``, "server shutting down") at shutdown, 500 when the
engine failed. A stream that had started ends instead with a ``data: {"error": {...}}`` event,
then ``data: [DONE]`` (as vLLM does). A field stepserve does not implement answers 400 naming
it. Extensions to OpenAI's API, as in vLLM: ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from service.api import pipeline, reasoning, tools
from service.api.errors import ERRORS, ApiError, client_closed
from service.api.reasoning import AnswerPlan
from service.api.schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice, OpenAISampling
from service.api.state import AppState, State
from service.engine.core import Engine
from service.engine.sequence import Event, FinalEvent, TokenEvent, TokenLogprob

router = APIRouter(prefix="/v1")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _usage(choices: list[_Choice]) -> dict:
    """Token counts over all choices; each prompt is counted once (its first choice's figures):
    ``prompt_tokens`` (of which ``prompt_tokens_details.cached_tokens`` came from the prefix
    cache), ``completion_tokens`` (of which ``completion_tokens_details.reasoning_tokens`` were
    spent reasoning, as :attr:`service.api.reasoning.AnswerStream.reasoning_tokens` counts them;
    0 on ``/v1/completions`` and for a model without a reasoning parser)."""
    finals = [c.final for c in choices if c.final is not None]
    firsts = [c.final for c in choices if c.final is not None and c.first_of_prompt]
    prompt = sum(f.prompt_tokens for f in firsts)
    completion = sum(f.completion_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in firsts)},
        "completion_tokens_details": {"reasoning_tokens": sum(c.reasoning_tokens for c in choices)},
    }


class _Tokens:
    """Token text for logprobs: each id decoded alone, special tokens included."""

    def __init__(self, engine: Engine):
        self._tok, self._seen = engine.model.tokenizer.tokenizer, {}

    def __call__(self, token_id: int) -> str:
        if (text := self._seen.get(token_id)) is None:
            text = self._seen[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text


class _Choice:
    """One choice's text, logprobs and tool calls as they arrive."""

    def __init__(self, index: int, gen: pipeline.Generation, plan: AnswerPlan | None, echo: str, first_of_prompt: bool):
        self.index, self.gen, self.first_of_prompt = index, gen, first_of_prompt
        self.text, self.logprobs = echo, list[TokenLogprob]()
        self.plan = plan  # chat: how the answer is read (reasoning, tool calls); None: plain text
        self.calls: list[dict] = []
        self.answer = plan.stream() if plan is not None else None  # the streamed parser
        self.final: FinalEvent | None = None
        self.echo = echo
        self.pieces: list[tuple[str, int]] = []  # (text, output tokens through it), not streamed
        self.reasoning_tokens = 0  # output tokens spent reasoning, once it ended


class _Route:
    """What one request's route decides: completions or chat, logprobs, tool form."""

    def __init__(self, chat: bool, engine: Engine, top: int | None, include_usage: bool):
        self.chat, self.top, self.include_usage = chat, top, include_usage
        self.model, self.token = engine.model.name, _Tokens(engine)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def logprobs(self, entries: list[TokenLogprob], offset: int = 0) -> dict | None:
        """OpenAI's ``logprobs`` of a choice (or a chunk) for these tokens; None when not asked."""
        if self.top is None:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": (t := self.token(e.token_id)),
                        "logprob": e.logprob,
                        "bytes": list(t.encode()),
                        "top_logprobs": [
                            {"token": (a := self.token(i)), "logprob": lp, "bytes": list(a.encode())} for i, lp in e.top
                        ],
                    }
                    for e in entries
                ]
            }
        tokens = [self.token(e.token_id) for e in entries]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token(i): lp for i, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model}
        out["choices"] = choices
        if self.include_usage:
            out["usage"] = usage
        return out


def _reason(choice: _Choice) -> str:
    """``tool_calls`` when the answer holds calls and ended by itself; else the engine's reason."""
    final = choice.final
    assert final is not None
    if choice.calls and final.finish_reason.value == "stop":
        return "tool_calls"
    return final.finish_reason.value


async def _generate(body: OpenAISampling, request: Request, state: AppState, chat: bool):
    if (field := body.unsupported()) is not None:
        raise ApiError(400, f"'{field}' is not supported by stepserve", param=field)
    engine = await pipeline.resolve_engine(state, body.model)
    max_tokens = body.max_completion_tokens or body.max_tokens or state.settings.default_max_tokens
    tool_form: tools.Form | None = None
    lark, rendered_tools, top, echo, variables = None, None, None, False, None
    if isinstance(body, ChatCompletionRequest):
        try:
            declared = tools.validate_tools([t.model_dump(exclude_none=True) for t in body.tools or []]) or None
            raw_choice = (
                body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
            )
            choice = tools.validate_tool_choice(raw_choice, declared or [])
            template = engine.model.tokenizer.chat_template
            planned = tools.plan(declared or [], choice, template)
            parser = state.reasoning_of(engine)
            variables = reasoning.template_controls(parser, template, body.reasoning_effort, "reasoning_effort")
        except ValueError as exc:
            raise ApiError(400, str(exc), param=str(exc).split(":", 1)[0]) from exc
        rendered_tools, tool_form, lark = planned.rendered, planned.form, planned.lark
        if lark is not None and body.response_format is not None and body.response_format.type != "text":
            raise ApiError(400, "response_format cannot be combined with a required tool call", param="tool_choice")
        top = (body.top_logprobs or 0) if body.logprobs else None
        pipeline.check_messages(body.messages)
        messages = [m.for_template() for m in body.messages]
        prompts: list = [None]
    else:
        assert isinstance(body, CompletionRequest)
        if body.suffix:
            raise ApiError(400, "'suffix' is not supported by stepserve (no fill-in-the-middle)", param="suffix")
        top, echo, messages, prompts = body.logprobs, body.echo, None, body.prompts
    grammar = pipeline.grammar(engine, body.response_format, lark, "tools" if lark else "response_format")
    sampling = body.sampling()
    route = _Route(chat, engine, top, bool(body.stream_options and body.stream_options.include_usage))
    choices: list[_Choice] = []
    try:
        for p, prompt in enumerate(prompts):
            param = f"prompt.{p}" if len(prompts) > 1 else "prompt"
            ids = await pipeline.prompt_ids(engine, prompt, messages, rendered_tools, param=param, variables=variables)
            plan = pipeline.answer_plan(state, engine, tool_form, ids) if chat else None
            echo_text = (prompt if isinstance(prompt, str) else engine.model.tokenizer.decode(ids)) if echo else ""
            for i in range(body.n):
                seed = None if body.seed is None else (body.seed + i) % 2**63
                params = pipeline.sampling_params(
                    engine, len(ids), max_tokens, **{**sampling, "seed": seed, "grammar": grammar, "logprobs": top}
                )
                gen = pipeline.start(state, engine, ids, params, keep_special=plan is not None and plan.keep_special)
                choices.append(_Choice(len(choices), gen, plan, echo_text, i == 0))
    except BaseException:
        for c in choices:
            c.gen.cancel()
        raise
    if body.stream:
        return await _stream(request, route, choices)
    return await _collect(request, route, choices)


async def _collect(request: Request, route: _Route, choices: list[_Choice]):
    async def one(choice: _Choice) -> bool:
        while True:
            event = await choice.gen.next_or_gone(request)
            if event is None:
                return False
            if isinstance(event, FinalEvent):
                choice.final = event
                return True
            choice.text += event.text
            choice.pieces.append((event.text, event.tokens))
            choice.logprobs += event.logprobs

    try:
        present = await asyncio.gather(*(one(c) for c in choices))
    finally:
        for c in choices:
            if c.final is None:
                c.gen.cancel()
    if not all(present):
        return client_closed()
    finals = [c.final for c in choices if c.final is not None]
    for final in finals:
        if error := pipeline.failure(final, partial_ends=False):
            raise error
    out = []
    for c in choices:
        item: dict = {"index": c.index, "logprobs": route.logprobs(c.logprobs, len(c.echo))}
        if route.chat:
            assert c.plan is not None
            thought, content, c.calls = c.plan.parse(c.text)
            assert c.final is not None
            c.reasoning_tokens = c.plan.reasoning_tokens(c.pieces, c.final.completion_tokens)
            message: dict = {"role": "assistant", "content": content or (None if c.calls else "")}
            if c.plan.parser is not None:
                message["reasoning_content"] = thought
            if c.calls:
                message["tool_calls"] = c.calls
            item["message"] = message
        else:
            item["text"] = c.text
        item["finish_reason"] = _reason(c)
        out.append(item)
    return {
        "id": route.id,
        "object": route.object,
        "created": route.created,
        "model": route.model,
        "choices": out,
        "usage": _usage(choices),
    }


async def _stream(request: Request, route: _Route, choices: list[_Choice]):
    """The first event of every choice is awaited before answering, so a request that fails
    at once answers with its HTTP status; then one server-sent event stream for all choices."""
    firsts = []
    for c in choices:
        event = await c.gen.next_or_gone(request)
        if event is None:
            for other in choices:
                other.gen.cancel()
            return client_closed()
        if isinstance(event, FinalEvent) and (error := pipeline.failure(event, partial_ends=False)):
            for other in choices:
                other.gen.cancel()
            raise error
        firsts.append(event)
    for c in choices:
        c.gen.unwatch()
    return StreamingResponse(_events(route, choices, firsts), media_type="text/event-stream", headers=_SSE_HEADERS)


def _data(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _arrivals(choices: list[_Choice], firsts: list) -> AsyncIterator[list[tuple[_Choice, Event]]]:
    """Each choice's events, in batches of those already queued (one write each): a single
    choice straight from its generation, several merged through one task each. Ends once
    every choice's final event came."""
    if len(choices) == 1:
        c, event = choices[0], firsts[0]
        while True:
            batch = [event, *c.gen.ready()]
            yield [(c, e) for e in batch]
            if isinstance(batch[-1], FinalEvent):
                return
            event = await c.gen.next()
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice, first) -> None:
        event = first
        while True:
            merged.put_nowait((c, event))
            if isinstance(event, FinalEvent):
                return
            event = await c.gen.next()

    tasks = [asyncio.create_task(pump(c, f)) for c, f in zip(choices, firsts, strict=True)]
    try:
        finished = 0
        while finished < len(choices):
            batch = [await merged.get()]
            while not merged.empty():
                batch.append(merged.get_nowait())
            finished += sum(isinstance(e, FinalEvent) for _, e in batch)
            yield batch
    finally:
        for t in tasks:
            t.cancel()


def _token_chunks(route: _Route, c: _Choice, event: TokenEvent) -> list[str]:
    """The server-sent events of one token event of choice ``c``."""
    lp = route.logprobs(list(event.logprobs), len(c.text))
    c.text += event.text
    if not route.chat:
        return [_data(route.chunk([{"index": c.index, "text": event.text, "logprobs": lp, "finish_reason": None}]))]
    assert c.answer is not None
    deltas = c.answer.feed(event.text, event.tokens)
    return [
        _data(route.chunk([{"index": c.index, "delta": d, "logprobs": lp if i == 0 else None, "finish_reason": None}]))
        for i, d in enumerate(deltas)
    ]


def _final_chunks(route: _Route, c: _Choice, event: FinalEvent) -> list[str]:
    """The server-sent events that end choice ``c``: an error, or its last deltas and finish reason."""
    c.final = event
    if error := pipeline.failure(event, partial_ends=False):
        return [_data(error.body())]
    out = []
    if c.answer is not None:
        for delta in c.answer.finish(event.completion_tokens):
            out.append(
                _data(route.chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}]))
            )
        c.calls = list(c.answer.calls)
        c.reasoning_tokens = c.answer.reasoning_tokens
    end = {"delta": {}} if route.chat else {"text": ""}
    out.append(_data(route.chunk([{"index": c.index, **end, "logprobs": None, "finish_reason": _reason(c)}])))
    return out


async def _events(route: _Route, choices: list[_Choice], firsts: list) -> AsyncIterator[str]:
    try:
        head = []
        if route.chat:  # the role first, for every choice (as OpenAI streams it)
            for c in choices:
                delta = {"role": "assistant", "content": ""}
                head.append(
                    _data(route.chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}]))
                )
        if any(c.echo for c in choices):
            for c in choices:
                head.append(
                    _data(route.chunk([{"index": c.index, "text": c.echo, "logprobs": None, "finish_reason": None}]))
                )
        if head:
            yield "".join(head)
        async for batch in _arrivals(choices, firsts):
            out: list[str] = []
            for c, event in batch:
                out += (
                    _token_chunks(route, c, event) if isinstance(event, TokenEvent) else _final_chunks(route, c, event)
                )
            yield "".join(out)
        if route.include_usage:
            yield _data({**route.chunk([], None), "usage": _usage(choices)})
        yield "data: [DONE]\n\n"
    finally:
        for c in choices:
            if c.final is None:
                c.gen.cancel()


@router.post("/completions", responses=ERRORS)
async def completions(body: CompletionRequest, request: Request, state: State):
    """OpenAI text completion of one prompt or several (text or token ids), ``n`` choices
    each, with ``logprobs`` (0-5), ``echo``, ``response_format`` and the vLLM extensions.
    ``finish_reason`` is ``stop`` or ``length``; a request ended early by its time limit or a
    shutdown answers 504 or 503, or, once streaming, a last ``{"error": ...}`` event before
    ``[DONE]``. Unsupported fields (``suffix``, ``best_of``, …) answer 400."""
    return await _generate(body, request, state, chat=False)


@router.post("/chat/completions", responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    """OpenAI chat completion, rendered with the model's chat template: ``n`` choices,
    ``logprobs``/``top_logprobs``, ``response_format``, ``tools`` and ``tool_choice``
    (docs/TOOL_CALLS.md); ``finish_reason`` ``tool_calls`` when the answer is tool calls;
    early ends as in ``/v1/completions``."""
    return await _generate(body, request, state, chat=True)
