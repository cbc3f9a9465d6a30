"""OpenAI's Responses API: ``POST /v1/responses`` (streamed and not) and ``GET
/v1/responses/{response_id}``, in the JSON shapes of OpenAI's API, so its SDKs work unchanged.

A request becomes the chat route's conversation (:class:`service.api.schemas.ChatMessage`
turns, rendered by the same chat template): ``instructions`` as a system turn first, then the
turns of ``previous_response_id`` (kept in :class:`service.api.response_store.ResponseStore`),
then ``input``: messages as turns, ``function_call`` items as the assistant's tool calls,
``function_call_output`` items as ``tool`` turns. Tools and ``tool_choice`` take the chat
route's path (:func:`service.api.tools.plan`): ``required`` and a named function are forced by
the grammar, so a call's ``arguments`` validate against its ``parameters``; ``text.format``
``json_schema`` is compiled by the same grammar engine as the chat route's ``response_format``.
The request then runs through :mod:`service.api.pipeline`, like ``/v1/messages``;
:class:`ResponsesFormat` shapes the answer as a response object or as OpenAI's named events.

``status`` is ``completed``, or ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``) when the output reached its limit. Errors are OpenAI's error object;
a field that would change the output and is not implemented (reasoning effort, built-in tools,
image and file inputs, ``include`` items stepserve cannot produce, ...) answers 400 naming it.
"""

from __future__ import annotations

import copy
import secrets
import time
from collections.abc import Callable

from fastapi import APIRouter, Request

from service.api import pipeline, tools
from service.api.errors import ERRORS, ApiError, Shape
from service.api.response_store import ResponseStore
from service.api.schemas import (
    RESPONSES_INCLUDABLE,
    ChatMessage,
    FunctionCallItem,
    FunctionCallOutputItem,
    ResponsesFunctionTool,
    ResponsesMessage,
    ResponsesNamedTool,
    ResponsesRequest,
    ResponsesText,
    ToolCall,
    ToolCallFunction,
)
from service.api.state import AppState, State
from service.api.tool_stream import ToolCallStream
from service.engine.core import Engine
from service.engine.sequence import FinalEvent, FinishReason

router = APIRouter(prefix="/v1")


def _chat(**fields) -> ChatMessage:
    """A chat turn (validated as the chat route's :class:`ChatMessage`)."""
    return ChatMessage.model_validate(fields)


def _text(content: str | list, where: str) -> str:
    """The text of a string or of text parts (joined as the chat route joins them).

    Raises:
        ApiError: 400 naming ``where.j.type`` for a part that is not text (images, files).
    """
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if not isinstance(part, ResponsesText):
            raise ApiError(
                400,
                f"content parts of type '{part.type}' are not supported; only input_text and output_text",
                param=f"{where}.{j}.type",
            )
    return "".join(p.text for p in content)


def conversation(items: str | list, where: str = "input") -> list[dict]:
    """The turns of a request's ``input`` as the chat template takes them
    (``ChatMessage.for_template``): a string is one user turn; ``function_call`` items join
    the assistant turn just before them (or start one), ``function_call_output`` items are
    ``tool`` turns answering their ``call_id``.

    Raises:
        ApiError: 400 naming ``input.i.type`` (or a part's) for what stepserve cannot render.
    """
    if isinstance(items, str):
        return [_chat(role="user", content=items).for_template()]
    turns: list[ChatMessage] = []
    joins = False  # the last turn is the assistant's: a function call joins it
    for i, item in enumerate(items):
        at = f"{where}.{i}"
        if isinstance(item, ResponsesMessage):
            turns.append(_chat(role=item.role, content=_text(item.content, f"{at}.content")))
            joins = item.role == "assistant"
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=ToolCallFunction(name=item.name, arguments=item.arguments))
            if joins:
                last = turns[-1]
                turns[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                turns.append(_chat(role="assistant", content=None, tool_calls=[call]))
            joins = True
        elif isinstance(item, FunctionCallOutputItem):
            output = _text(item.output, f"{at}.output")
            turns.append(_chat(role="tool", content=output, tool_call_id=item.call_id))
            joins = False
        else:
            raise ApiError(
                400,
                f"input items of type '{item.type}' are not supported; only message, function_call and "
                "function_call_output",
                param=f"{at}.type",
            )
    return [t.for_template() for t in turns]


def output_turns(output: list[dict]) -> list[dict]:
    """The assistant turn of a response's ``output`` items (what :func:`conversation` makes of
    them sent back): its text, and its function calls as tool calls."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        ToolCall(id=item["call_id"], function=ToolCallFunction(name=item["name"], arguments=item["arguments"]))
        for item in output
        if item["type"] == "function_call"
    ]
    return [_chat(role="assistant", content=text or (None if calls else ""), tool_calls=calls or None).for_template()]


def tool_plan(body: ResponsesRequest, engine: Engine) -> tools.ToolPlan:
    """The request's function tools and ``tool_choice`` checked and planned as the chat route does.

    Raises:
        ApiError: 400 naming the field (``tools.0.type`` of a built-in tool, ``tools.0.parameters``,
            ``parallel_tool_calls`` false where more than one call may come, ...).
    """
    declared = []
    for i, tool in enumerate(body.tools or []):
        if not isinstance(tool, ResponsesFunctionTool):
            message = f"tools of type '{tool.type}' are not supported; only function"
            raise ApiError(400, message, param=f"tools.{i}.type")
        function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
        declared.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    choice = body.tool_choice
    raw = {"type": "function", "function": {"name": choice.name}} if isinstance(choice, ResponsesNamedTool) else choice
    try:
        checked = tools.validate_tools(declared)
        planned = tools.validate_tool_choice(raw, checked)
    except ValueError as exc:
        message = str(exc).replace(".function.", ".")  # the chat route's field names in the Responses API's
        raise ApiError(400, message, param=message.split(":", 1)[0]) from exc
    if body.parallel_tool_calls is False and planned.mode in ("auto", "required"):
        raise ApiError(
            400,
            f"parallel_tool_calls false is not supported with tool_choice '{planned.mode}' (only a named "
            "function or none, which make one call at most)",
            param="parallel_tool_calls",
        )
    return tools.plan(checked, planned, engine.model.tokenizer.chat_template)


def _check(body: ResponsesRequest, engine: Engine) -> None:
    """400 naming a field that would change the output and is not implemented."""
    if (field := body.unsupported()) is not None:
        raise ApiError(400, f"'{field}' is not supported by stepserve", param=field)
    if body.background:
        raise ApiError(400, "background responses are not supported; answers come in the request", param="background")
    reasoning = body.reasoning
    if reasoning is not None:
        if reasoning.effort not in (None, "none"):
            message = f"model '{engine.model.name}' does not reason: only effort null or 'none' is served"
            raise ApiError(400, message, param="reasoning.effort")
        summaries = {"summary": reasoning.summary, "generate_summary": reasoning.generate_summary}
        asked = [k for k, v in summaries.items() if v is not None] + list(reasoning.model_extra or {})
        if field := next(iter(asked), None):
            raise ApiError(400, f"model '{engine.model.name}' does not reason", param=f"reasoning.{field}")
    for j, item in enumerate(body.include or []):
        if item not in RESPONSES_INCLUDABLE:
            raise ApiError(400, f"include item '{item}' cannot be produced by stepserve", param=f"include.{j}")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise ApiError(400, "only verbosity 'medium' (the default) is served", param="text.verbosity")


def _previous(body: ResponsesRequest, store: ResponseStore) -> list[dict]:
    """The conversation of ``previous_response_id`` through its output ([] when unset).

    Raises:
        ApiError: 400 naming ``previous_response_id`` when it is not kept (as OpenAI answers).
    """
    if body.previous_response_id is None:
        return []
    entry = store.get(body.previous_response_id)
    if entry is None:
        raise ApiError(
            400,
            f"previous response with id '{body.previous_response_id}' not found (never kept, sent with store "
            "false, or evicted from the responses_store_bytes kept)",
            param="previous_response_id",
        )
    return list(entry.turns)


async def _prompt(body: ResponsesRequest, state: AppState) -> tuple[Engine, list[int], tools.ToolPlan, list[dict]]:
    """The engine, the prompt's token ids, the tool plan and the conversation (without
    ``instructions``: what a follow-up continues) of a request."""
    engine = await pipeline.resolve_engine(state, body.model)
    _check(body, engine)
    planned = tool_plan(body, engine)
    turns = _previous(body, state.responses) + conversation(body.input)
    system = [_chat(role="system", content=body.instructions).for_template()] if body.instructions else []
    ids = await pipeline.prompt_ids(engine, None, system + turns, planned.rendered, param="input")
    return engine, ids, planned, turns


def skeleton(body: ResponsesRequest, model: str) -> dict:
    """The response object of ``body`` before any output (``status`` ``in_progress``): a new
    ``id`` and the request's settings echoed as OpenAI echoes them."""
    text_format = body.text.format if body.text is not None else None
    choice = body.tool_choice
    return {
        "id": f"resp_{secrets.token_hex(24)}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {
            "format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"},
            "verbosity": "medium",
        },
        "tool_choice": choice.model_dump() if isinstance(choice, ResponsesNamedTool) else choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "usage": None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def _usage(final: FinalEvent) -> dict:
    return {
        "input_tokens": final.prompt_tokens,
        "input_tokens_details": {"cached_tokens": final.cached_tokens},
        "output_tokens": final.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


def _message_item() -> dict:
    return {"id": f"msg_{secrets.token_hex(24)}", "type": "message", "status": "in_progress", "role": "assistant"}


def _text_part(text: str = "") -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _call_item(call: dict) -> dict:
    """A ``function_call`` output item of a parsed call (the chat route's shape, ``id`` ``call_…``)."""
    fn = call["function"]
    return {
        "id": f"fc_{secrets.token_hex(24)}",
        "type": "function_call",
        "status": "completed",
        "arguments": fn["arguments"],
        "call_id": call["id"],
        "name": fn["name"],
    }


class ResponsesFormat:
    """``/v1/responses`` answers (:class:`service.api.pipeline.ResponseFormat`): a response
    object, or OpenAI's named events, each with its ``sequence_number``: ``response.created``,
    ``response.in_progress``; per message ``response.output_item.added``,
    ``response.content_part.added``, ``response.output_text.delta`` (one per text piece),
    ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``;
    per function call ``response.output_item.added``, ``response.function_call_arguments.delta``
    (the whole arguments), ``response.function_call_arguments.done``,
    ``response.output_item.done``; then ``response.completed`` or ``response.incomplete``. A
    stream that fails ends with ``error`` and ``response.failed``. Tool calls are parsed as they
    stream in the template's form (:class:`service.api.tool_stream.ToolCallStream`).

    ``keep`` is called with the finished response object (not a failed one)."""

    done_marker = False
    partial_ends = False  # a request ended early answers as an error, as on the other OpenAI routes
    shape: Shape = "openai"
    named_events = True

    def __init__(self, response: dict, form: tools.Form | None, keep: Callable[[dict], None] | None = None):
        self.response, self._keep = response, keep
        self.form: tools.Form | None = form
        self._calls = ToolCallStream(form) if form is not None else None
        self._sequence = 0  # the next event's sequence_number
        self._started = False
        self._message: dict | None = None  # the message item still open
        self._message_index = 0  # its output_index

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _start(self) -> list[dict]:
        if self._started:
            return []
        self._started = True
        return [
            self._event(kind, response=copy.deepcopy(self.response))
            for kind in ("response.created", "response.in_progress")
        ]

    def _add(self, item: dict) -> tuple[int, dict]:
        """Append ``item`` to the output: (its output_index, its ``output_item.added`` event)."""
        self.response["output"].append(item)
        index = len(self.response["output"]) - 1
        return index, self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item))

    def _open_message(self) -> list[dict]:
        item = {**_message_item(), "content": []}
        self._message_index, added = self._add(item)
        self._message = item
        part = _text_part()
        item["content"].append(part)
        where = {"item_id": item["id"], "output_index": self._message_index, "content_index": 0}
        return [added, self._event("response.content_part.added", **where, part=dict(part))]

    def _text_delta(self, text: str) -> list[dict]:
        out = self._open_message() if self._message is None else []
        assert self._message is not None
        self._message["content"][0]["text"] += text
        where = {"item_id": self._message["id"], "output_index": self._message_index, "content_index": 0}
        return [*out, self._event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def _close_message(self, status: str) -> list[dict]:
        item, self._message = self._message, None
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": self._message_index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **where, part=dict(part)),
            self._event("response.output_item.done", output_index=self._message_index, item=copy.deepcopy(item)),
        ]

    def _call(self, call: dict) -> list[dict]:
        done = _call_item(call)
        index, added = self._add({**done, "status": "in_progress", "arguments": ""})
        self.response["output"][index] = done
        where = {"item_id": done["id"], "output_index": index}
        return [
            added,
            self._event("response.function_call_arguments.delta", **where, delta=done["arguments"]),
            self._event("response.function_call_arguments.done", **where, arguments=done["arguments"]),
            self._event("response.output_item.done", output_index=index, item=dict(done)),
        ]

    def _deltas(self, deltas: list[dict]) -> list[dict]:
        """The events of the chat route's deltas (``content``, ``tool_calls``)."""
        out: list[dict] = []
        for delta in deltas:
            if text := delta.get("content"):
                out += self._text_delta(text)
            for call in delta.get("tool_calls") or []:
                out += self._close_message("completed") + self._call(call)
        return out

    def _finish(self, final: FinalEvent) -> dict:
        """The finished response object (kept when asked)."""
        incomplete = final.finish_reason is FinishReason.LENGTH
        self.response["status"] = "incomplete" if incomplete else "completed"
        self.response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        self.response["usage"] = _usage(final)
        if self._keep is not None:
            self._keep(self.response)
        return self.response

    def chunks(self, text: str, logprobs: tuple = ()) -> list[dict]:
        deltas = self._calls.feed(text) if self._calls is not None else [{"content": text}]
        return self._start() + self._deltas(deltas)

    def add(self, logprobs: tuple) -> None:
        """Nothing to keep: Responses answers carry no logprobs."""

    def final_chunks(self, final: FinalEvent) -> list[dict]:
        out = self._start() + self._deltas(self._calls.finish() if self._calls is not None else [])
        if not self.response["output"]:  # no text and no call: one empty message
            out += self._open_message()
        out += self._close_message("incomplete" if final.finish_reason is FinishReason.LENGTH else "completed")
        response = self._finish(final)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [*out, self._event(kind, response=response)]

    def error_chunks(self, error: ApiError) -> list[dict]:
        """``error`` (OpenAI's error event) and ``response.failed`` (the response, ``status``
        ``failed``, its ``error``)."""
        out = self._start()
        self.response["status"] = "failed"
        self.response["error"] = {"code": "server_error", "message": error.message}
        return [
            *out,
            self._event("error", code=str(error.status), message=error.message, param=error.param),
            self._event("response.failed", response=self.response),
        ]

    def body(self, text: str, final: FinalEvent) -> dict:
        content, calls = tools.parse_tool_calls(text, self.form) if self.form is not None else (text, [])
        status = "incomplete" if final.finish_reason is FinishReason.LENGTH else "completed"
        if content or not calls:
            message = {**_message_item(), "status": status, "content": [_text_part(content or "")]}
            self.response["output"].append(message)
        self.response["output"] += [_call_item(c) for c in calls]
        return self._finish(final)


def _keeper(store: ResponseStore, turns: list[dict]) -> Callable[[dict], None]:
    """What keeps a finished response with its conversation (``turns`` and its output)."""

    def keep(response: dict) -> None:
        store.put(response, turns + output_turns(response["output"]))

    return keep


@router.post("/responses", responses={**ERRORS, 200: {"content": {"text/event-stream": {}}}})
async def create_response(body: ResponsesRequest, request: Request, state: State):
    """OpenAI's Responses API: the answer as a response object (``message`` and
    ``function_call`` output items), or with ``stream`` as OpenAI's named server-sent events;
    ``input`` as text or items, ``instructions``, function ``tools``, ``tool_choice``,
    ``text.format`` (``json_schema`` through the grammar), ``max_output_tokens``,
    ``temperature``, ``top_p``, ``previous_response_id`` and ``store``."""
    engine, ids, planned, turns = await _prompt(body, state)
    text_format = body.text.format if body.text is not None else None
    if planned.lark is not None and text_format is not None and text_format.type != "text":
        raise ApiError(400, "text.format cannot be combined with a required tool call", param="text.format")
    response_format = text_format.response_format() if text_format is not None else None
    params = pipeline.sampling_params(
        engine,
        len(ids),
        body.max_output_tokens or state.settings.default_max_tokens,
        param="max_output_tokens",
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        grammar=pipeline.grammar(engine, response_format, planned.lark, "tools" if planned.lark else "text.format"),
    )
    keep = _keeper(state.responses, turns) if body.store is not False else None
    fmt = ResponsesFormat(skeleton(body, engine.model.name), planned.form, keep)
    gen = pipeline.start(state, engine, ids, params)
    return await pipeline.respond(request, gen, fmt, body.stream)


@router.get("/responses/{response_id}", responses=ERRORS)
async def retrieve_response(response_id: str, state: State) -> dict:
    """A kept response object (created with ``store`` true, not yet evicted); else 404."""
    entry = state.responses.get(response_id)
    if entry is None:
        raise ApiError(
            404,
            f"no response with id '{response_id}' is kept (never kept, sent with store false, or evicted)",
            param="response_id",
        )
    return entry.response
