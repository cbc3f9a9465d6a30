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

from service.api import pipeline, reasoning, tools
from service.api.errors import ERRORS, ApiError, Shape
from service.api.reasoning import AnswerPlan
from service.api.response_store import ResponseStore
from service.api.schemas import (
    RESPONSES_INCLUDABLE,
    ChatMessage,
    FunctionCallItem,
    FunctionCallOutputItem,
    ReasoningItem,
    ResponsesFunctionTool,
    ResponsesMessage,
    ResponsesNamedTool,
    ResponsesRequest,
    ResponsesText,
    ToolCall,
    ToolCallFunction,
)
from service.api.state import AppState, State
from service.engine.core import Engine
from service.engine.sequence import FinalEvent, FinishReason, TokenEvent

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
        elif isinstance(item, ReasoningItem):
            continue  # past reasoning stays out of the prompt (the templates drop it too)
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
        if body.parallel_tool_calls is False and planned.mode in ("auto", "required"):
            raise ApiError(
                400,
                f"parallel_tool_calls false is not supported with tool_choice '{planned.mode}' (only a named "
                "function or none, which make one call at most)",
                param="parallel_tool_calls",
            )
        return tools.plan(checked, planned, engine.model.tokenizer.chat_template)
    except ValueError as exc:
        message = str(exc).replace(".function.", ".")  # the chat route's field names in the Responses API's
        raise ApiError(400, message, param=message.split(":", 1)[0]) from exc


def _check(body: ResponsesRequest, engine: Engine, parser: reasoning.Parser | None) -> dict:
    """400 naming a field that would change the output and is not implemented; else the
    template variables that honour ``reasoning.effort``
    (:func:`service.api.reasoning.template_controls`). A reasoning summary is never written:
    ``summary`` ``auto`` (the server's choice, Codex CLI's default) is served with none, where
    the model reasons; ``concise`` and ``detailed`` answer 400."""
    if (field := body.unsupported()) is not None:
        raise ApiError(400, f"'{field}' is not supported by stepserve", param=field)
    if body.background:
        raise ApiError(400, "background responses are not supported; answers come in the request", param="background")
    variables: dict = {}
    if (config := body.reasoning) is not None:
        try:
            variables = reasoning.template_controls(
                parser, engine.model.tokenizer.chat_template, config.effort, "reasoning.effort"
            )
        except ValueError as exc:
            raise ApiError(400, f"model '{engine.model.name}': {exc}", param="reasoning.effort") from exc
        summaries = {"summary": config.summary, "generate_summary": config.generate_summary}
        asked = [k for k, v in summaries.items() if v is not None and not (parser and v == "auto")]
        if field := next(iter(asked + list(config.model_extra or {})), None):
            message = "no reasoning summary is written (only 'auto', with none)" if parser else "does not reason"
            raise ApiError(400, f"model '{engine.model.name}': {message}", param=f"reasoning.{field}")
    for j, item in enumerate(body.include or []):
        if item not in RESPONSES_INCLUDABLE:
            raise ApiError(400, f"include item '{item}' cannot be produced by stepserve", param=f"include.{j}")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise ApiError(400, "only verbosity 'medium' (the default) is served", param="text.verbosity")
    return variables


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
    variables = _check(body, engine, state.reasoning_of(engine))
    planned = tool_plan(body, engine)
    turns = _previous(body, state.responses) + conversation(body.input)
    system = [_chat(role="system", content=body.instructions).for_template()] if body.instructions else []
    ids = await pipeline.prompt_ids(engine, None, system + turns, planned.rendered, param="input", variables=variables)
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
        "reasoning": {
            "effort": body.reasoning.effort if body.reasoning else None,
            "summary": body.reasoning.summary if body.reasoning else None,
        },
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


def usage(final: FinalEvent, reasoning_tokens: int = 0) -> dict:
    """A response's ``usage`` (token counts): ``input_tokens`` all the prompt's, of which
    ``input_tokens_details.cached_tokens`` came from the prefix cache; ``output_tokens`` all the
    generated ones, of which ``output_tokens_details.reasoning_tokens`` (``reasoning_tokens``,
    :attr:`service.api.reasoning.AnswerStream.reasoning_tokens`) were spent reasoning."""
    return {
        "input_tokens": final.prompt_tokens,
        "input_tokens_details": {"cached_tokens": final.cached_tokens},
        "output_tokens": final.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


def _message_item() -> dict:
    return {"id": f"msg_{secrets.token_hex(24)}", "type": "message", "status": "in_progress", "role": "assistant"}


def _text_part(text: str = "") -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _reasoning_item(text: str = "", status: str = "in_progress") -> dict:
    """A ``reasoning`` output item: the reasoning as ``content`` (``reasoning_text``), no summary."""
    content = [{"type": "reasoning_text", "text": text}]
    return {
        "id": f"rs_{secrets.token_hex(24)}",
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": content,
    }


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
    stream in the template's form and reasoning apart (:class:`service.api.reasoning.AnswerStream`):
    a ``reasoning`` item first (``output_item.added``, ``content_part.added`` of a
    ``reasoning_text`` part, ``response.reasoning_text.delta`` per piece,
    ``response.reasoning_text.done``, ``content_part.done``, ``output_item.done``).

    ``keep`` is called with the finished response object (not a failed one)."""

    done_marker = False
    partial_ends = False  # a request ended early answers as an error, as on the other OpenAI routes
    shape: Shape = "openai"
    named_events = True

    def __init__(self, response: dict, plan: AnswerPlan, keep: Callable[[dict], None] | None = None):
        self.response, self._keep = response, keep
        self.plan = plan
        self._answer = plan.stream()
        self._pieces: list[tuple[str, int]] = []  # (text, output tokens through it) not streamed
        self._reasoning: dict | None = None  # the reasoning item still open
        self._reasoning_index = 0
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

    def _reasoning_delta(self, text: str) -> list[dict]:
        out: list[dict] = []
        if self._reasoning is None:
            self._reasoning = _reasoning_item()
            self._reasoning["content"][0]["text"] = ""
            self._reasoning_index, added = self._add(self._reasoning)
            where = {"item_id": self._reasoning["id"], "output_index": self._reasoning_index, "content_index": 0}
            part = {"type": "reasoning_text", "text": ""}
            out += [added, self._event("response.content_part.added", **where, part=part)]
        self._reasoning["content"][0]["text"] += text
        where = {"item_id": self._reasoning["id"], "output_index": self._reasoning_index, "content_index": 0}
        return [*out, self._event("response.reasoning_text.delta", **where, delta=text)]

    def _close_reasoning(self, status: str = "completed") -> list[dict]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        item["status"] = status
        part = dict(item["content"][0])
        where = {"item_id": item["id"], "output_index": self._reasoning_index, "content_index": 0}
        return [
            self._event("response.reasoning_text.done", **where, text=part["text"]),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=self._reasoning_index, item=copy.deepcopy(item)),
        ]

    def _deltas(self, deltas: list[dict]) -> list[dict]:
        """The events of the chat route's deltas (``reasoning_content``, ``content``, ``tool_calls``)."""
        out: list[dict] = []
        for delta in deltas:
            if thought := delta.get("reasoning_content"):
                out += self._close_message("completed") + self._reasoning_delta(thought)
            if text := delta.get("content"):
                out += self._close_reasoning() + self._text_delta(text)
            for call in delta.get("tool_calls") or []:
                out += self._close_reasoning() + self._close_message("completed") + self._call(call)
        return out

    def _finish(self, final: FinalEvent, reasoning_tokens: int) -> dict:
        """The finished response object (kept when asked)."""
        incomplete = final.finish_reason is FinishReason.LENGTH
        self.response["status"] = "incomplete" if incomplete else "completed"
        self.response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        self.response["usage"] = usage(final, reasoning_tokens)
        if self._keep is not None:
            self._keep(self.response)
        return self.response

    def chunks(self, text: str, logprobs: tuple = (), tokens: int | None = None) -> list[dict]:
        return self._start() + self._deltas(self._answer.feed(text, tokens))

    def add(self, event: TokenEvent) -> None:
        """Keep the piece's text and token count (for the reasoning tokens; no logprobs here)."""
        self._pieces.append((event.text, event.tokens))

    def final_chunks(self, final: FinalEvent) -> list[dict]:
        out = self._start() + self._deltas(self._answer.finish(final.completion_tokens))
        status = "incomplete" if final.finish_reason is FinishReason.LENGTH else "completed"
        out += self._close_reasoning(status)
        if not any(item["type"] != "reasoning" for item in self.response["output"]):  # no text, no call
            out += self._open_message()
        out += self._close_message(status)
        response = self._finish(final, self._answer.reasoning_tokens)
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
        thought, content, calls = self.plan.parse(text)
        status = "incomplete" if final.finish_reason is FinishReason.LENGTH else "completed"
        if thought is not None:
            self.response["output"].append(_reasoning_item(thought, "completed" if content or calls else status))
        if content or not calls:
            message = {**_message_item(), "status": status, "content": [_text_part(content or "")]}
            self.response["output"].append(message)
        self.response["output"] += [_call_item(c) for c in calls]
        return self._finish(final, self.plan.reasoning_tokens(self._pieces, final.completion_tokens))


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
    plan = pipeline.answer_plan(state, engine, planned.form, ids)
    fmt = ResponsesFormat(skeleton(body, engine.model.name), plan, keep)
    gen = pipeline.start(state, engine, ids, params, keep_special=plan.keep_special)
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
