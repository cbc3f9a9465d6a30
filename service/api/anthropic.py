"""Anthropic's Messages API: ``POST /v1/messages`` (streamed and not) and ``POST
/v1/messages/count_tokens``, in the JSON shapes of Anthropic's API, so its SDKs work unchanged.

A request becomes the chat route's conversation (:class:`service.api.schemas.ChatMessage`
turns, rendered by the same chat template): ``system`` first, ``tool_use`` blocks as the
assistant's tool calls, ``tool_result`` blocks as ``tool`` turns. Tools and ``tool_choice`` take
the chat route's path too (:func:`service.api.tools.plan`): ``any`` and ``tool`` are forced by
the grammar, so the call's ``input`` validates against its ``input_schema``. The request then
runs through :mod:`service.api.pipeline`, like ``/infer``; :class:`MessagesFormat` shapes the
answer as a message or as Anthropic's named server-sent events.

``stop_reason``: ``end_turn``, ``max_tokens``, ``stop_sequence`` (with the matched
``stop_sequence``) or ``tool_use``. Errors are Anthropic's ``{"type": "error", "error": {...}}``
(:mod:`service.api.errors`); a field that would change the output and is not implemented
(a ``thinking`` budget, thinking on a model that does not think, image and document blocks, a
last assistant turn to continue) answers 400 naming it. A model that thinks
(``reasoning_parser``) answers with a ``thinking`` block first.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

from fastapi import APIRouter, Request

from service.api import pipeline, reasoning, tools
from service.api.errors import ApiError, Shape
from service.api.reasoning import AnswerPlan
from service.api.schemas import (
    AnthropicErrorBody,
    ChatMessage,
    MessagesInput,
    MessagesRequest,
    TextBlock,
    TokenCount,
    ToolCall,
    ToolCallFunction,
    ToolResultBlock,
    ToolUseBlock,
)
from service.api.state import AppState, State
from service.engine.core import Engine
from service.engine.sequence import FinalEvent, FinishReason, TokenEvent

router = APIRouter(prefix="/v1")
ERRORS: dict[int | str, dict] = {
    code: {"model": AnthropicErrorBody} for code in (400, 401, 404, 413, 429, 500, 503, 504)
}
# Anthropic's tool_choice types as the chat route's (tools.validate_tool_choice)
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _chat(**fields) -> ChatMessage:
    """A chat turn (validated as the chat route's :class:`ChatMessage`)."""
    return ChatMessage.model_validate(fields)


def _text(blocks: str | list, where: str) -> str:
    """The text of a string or a list of text blocks (joined as the chat route joins text parts).

    Raises:
        ApiError: 400 naming ``where.j.type`` for a block that is not text.
    """
    if isinstance(blocks, str):
        return blocks
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise ApiError(
                400, f"blocks of type '{block.type}' are not supported here; only text", param=f"{where}.{j}.type"
            )
    return "".join(b.text for b in blocks)


def _turn(i: int, role: str, blocks: list) -> list[ChatMessage]:
    """The chat turns of message ``i``'s blocks: an assistant turn with its text and tool calls,
    or a user turn's text with each ``tool_result`` as a ``tool`` turn, in order.

    Raises:
        ApiError: 400 naming ``messages.i.content.j.type`` for a block this role cannot carry
            or a type not served (images, documents, thinking).
    """
    out: list[ChatMessage] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock) and role == "assistant":
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(ToolCall(id=block.id, function=ToolCallFunction(name=block.name, arguments=arguments)))
        elif isinstance(block, ToolResultBlock) and role == "user":
            if texts:  # text before a result keeps its place
                out.append(_chat(role="user", content="".join(texts)))
                texts = []
            result = _text(block.content, f"{where}.content")
            content = f"Error: {result}" if block.is_error else result
            out.append(_chat(role="tool", content=content, tool_call_id=block.tool_use_id))
        elif block.type in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # past thinking stays out of the prompt (the templates drop it too)
        else:
            allowed = "text and tool_use" if role == "assistant" else "text and tool_result"
            raise ApiError(
                400, f"{role} blocks of type '{block.type}' are not supported; only {allowed}", param=f"{where}.type"
            )
    if role == "assistant":
        out.append(_chat(role="assistant", content="".join(texts) or (None if calls else ""), tool_calls=calls or None))
    elif texts:
        out.append(_chat(role="user", content="".join(texts)))
    return out


def conversation(body: MessagesInput) -> list[dict]:
    """The request's turns as the chat template takes them (``ChatMessage.for_template``).

    Raises:
        ApiError: 400 naming the block or turn that stepserve cannot render.
    """
    turns: list[ChatMessage] = []
    if body.system is not None:
        turns.append(_chat(role="system", content=_text(body.system, "system")))
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            turns.append(_chat(role=message.role, content=message.content))
        else:
            turns += _turn(i, message.role, message.content)
    if body.messages[-1].role == "assistant":
        raise ApiError(
            400,
            "continuing a last assistant turn (prefill) is not supported; end with a user turn",
            param=f"messages.{len(body.messages) - 1}.role",
        )
    return [t.for_template() for t in turns]


def _renamed(message: str) -> str:
    """A tools error of the chat route's field names in Anthropic's (``tools.0.input_schema``)."""
    for chat, anthropic in (
        (".function.parameters", ".input_schema"),
        (".function.", "."),
        ("tool_choice: 'required'", "tool_choice: 'any'"),
    ):
        message = message.replace(chat, anthropic)
    return message


def tool_plan(body: MessagesInput, engine: Engine) -> tools.ToolPlan:
    """The request's tools and ``tool_choice`` checked and planned as the chat route does.

    Raises:
        ApiError: 400 naming the field (a tool's ``input_schema``, ``tool_choice.name``, ...).
    """
    declared = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                **({"description": t.description} if t.description else {}),
                "parameters": t.input_schema,
            },
        }
        for t in body.tools or []
    ]
    choice = body.tool_choice
    if choice is not None and choice.disable_parallel_tool_use and choice.type in ("auto", "any"):
        raise ApiError(
            400,
            f"disable_parallel_tool_use is not supported with type '{choice.type}' (only 'tool' and 'none')",
            param="tool_choice.disable_parallel_tool_use",
        )
    raw = None
    if choice is not None:
        raw = (
            {"type": "function", "function": {"name": choice.name}} if choice.type == "tool" else _CHOICES[choice.type]
        )
    try:
        checked = tools.validate_tools(declared)
        planned = tools.validate_tool_choice(raw, checked)
        return tools.plan(checked, planned, engine.model.tokenizer.chat_template)
    except ValueError as exc:
        message = _renamed(str(exc))
        raise ApiError(400, message, param=message.split(":", 1)[0]) from exc


# Anthropic's thinking types as a reasoning effort (reasoning.template_controls)
_THINKING = {"disabled": "none", "adaptive": "medium"}


def _check(body: MessagesInput, engine: Engine, parser: reasoning.Parser | None) -> dict:
    """400 for a field that would change the output and is not implemented; else the template
    variables that honour ``thinking``: ``disabled`` and ``adaptive`` as reasoning efforts
    ``none`` and ``medium`` (:func:`service.api.reasoning.template_controls`); ``enabled``
    answers 400 naming ``thinking.budget_tokens`` (a thinking budget is not enforced)."""
    if (field := body.unsupported()) is not None:
        raise ApiError(400, f"'{field}' is not supported by stepserve", param=field)
    thinking = body.thinking
    if thinking is None:
        return {}
    if thinking.type == "enabled" and parser is not None:
        message = 'a thinking budget cannot be enforced; send {"type": "adaptive"} to think'
        raise ApiError(400, message, param="thinking.budget_tokens")
    if thinking.type not in _THINKING:
        if parser is None:
            message = f'model \'{engine.model.name}\' does not think: only {{"type": "disabled"}} is served'
            raise ApiError(400, message, param="thinking")
        raise ApiError(400, "thinking.type: must be 'adaptive' or 'disabled'", param="thinking.type")
    try:
        return reasoning.template_controls(
            parser, engine.model.tokenizer.chat_template, _THINKING[thinking.type], "thinking"
        )
    except ValueError as exc:
        raise ApiError(400, f"model '{engine.model.name}': {exc}", param="thinking") from exc


async def _prompt(body: MessagesInput, state: AppState) -> tuple[Engine, list[int], tools.ToolPlan]:
    """The engine, the prompt's token ids and the tool plan of a Messages request (the same
    for ``/v1/messages`` and its ``count_tokens``)."""
    engine = await pipeline.resolve_engine(state, body.model)
    variables = _check(body, engine, state.reasoning_of(engine))
    planned = tool_plan(body, engine)
    ids = await pipeline.prompt_ids(
        engine, None, conversation(body), planned.rendered, param="messages", variables=variables
    )
    return engine, ids, planned


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """A message's ``usage`` as Anthropic counts it: the prompt's ``prompt_tokens`` split into
    ``cache_read_input_tokens`` (``cached_tokens``, from the prefix cache),
    ``cache_creation_input_tokens`` (always 0: stepserve caches prefixes by itself, with no
    ``cache_control`` breakpoint to write) and ``input_tokens`` (the rest, prefilled), so the
    three add up to ``prompt_tokens``; ``output_tokens`` generated. Counts of tokens."""
    cached = min(cached_tokens, prompt_tokens)
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


class MessagesFormat:
    """``/v1/messages`` answers (:class:`service.api.pipeline.ResponseFormat`): a message, or
    Anthropic's events: ``message_start``, ``ping``, per content block ``content_block_start``,
    ``content_block_delta`` (``thinking_delta`` in a ``thinking`` block, ``text_delta``; a tool
    call's whole ``input`` as one ``input_json_delta``) and ``content_block_stop``, then
    ``message_delta`` (``stop_reason``, the whole ``usage`` as at the end) and ``message_stop``.
    Thinking and tool calls are parsed as they stream
    (:class:`service.api.reasoning.AnswerStream`); a thinking block's ``signature`` is empty
    (stepserve signs nothing).

    ``usage`` (:func:`usage`): ``message_start`` carries the prompt's split as it stands at the
    first token (``cached``: the prompt tokens the prefix cache held then), ``output_tokens`` 0;
    ``message_delta`` and the whole message the request's end figures."""

    done_marker = False
    partial_ends = False  # a request ended early answers as an error, as on the OpenAI routes
    shape: Shape = "anthropic"
    named_events = True

    def __init__(self, model: str, input_tokens: int, plan: AnswerPlan, cached: Callable[[], int] = lambda: 0):
        self.id, self.model, self.input_tokens = f"msg_{secrets.token_hex(12)}", model, input_tokens
        self._cached = cached
        self.plan = plan
        self._answer = plan.stream()
        self._started = False
        self._blocks = 0  # content blocks opened so far
        self._open: str | None = None  # the type of the last block ("text", "thinking") while it is open
        self._used_tools = False

    def _message(self, content: list[dict], final: FinalEvent | None) -> dict:
        reason, stop = self._stop_reason(final) if final is not None else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop,
            "usage": self._usage(final),
        }

    def _usage(self, final: FinalEvent | None) -> dict:
        """The request's end figures, or before its end the prompt's (nothing generated yet)."""
        if final is not None:
            return usage(final.prompt_tokens, final.cached_tokens, final.completion_tokens)
        return usage(self.input_tokens, self._cached(), 0)

    def _stop_reason(self, final: FinalEvent) -> tuple[str, str | None]:
        """(``stop_reason``, ``stop_sequence``) of a request's end."""
        if final.finish_reason is FinishReason.LENGTH:
            return "max_tokens", None
        if self._used_tools:
            return "tool_use", None
        if final.stop_string is not None:
            return "stop_sequence", final.stop_string
        return "end_turn", None

    def _start(self, final: FinalEvent | None = None) -> list[dict]:
        """``message_start`` and ``ping`` once (``final``: the request ended before its first
        token event; its figures, less the output)."""
        if self._started:
            return []
        self._started = True
        message = self._message([], None)
        if final is not None:
            message["usage"] = usage(final.prompt_tokens, final.cached_tokens, 0)
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _close_text(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._blocks - 1}]

    def _block_delta(self, kind: str, text: str) -> list[dict]:
        """A ``text`` or ``thinking`` block's delta, the block opened first if it is not."""
        out = [] if self._open == kind else self._close_text()
        if self._open != kind:
            block = _text_block("") if kind == "text" else _thinking_block("")
            out.append({"type": "content_block_start", "index": self._blocks, "content_block": block})
            self._blocks, self._open = self._blocks + 1, kind
        delta = _text_delta(text) if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return [*out, {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}]

    def _deltas(self, deltas: list[dict]) -> list[dict]:
        """Anthropic's block events for the chat route's deltas (``reasoning_content``,
        ``content``, ``tool_calls``)."""
        out: list[dict] = []
        for delta in deltas:
            if thought := delta.get("reasoning_content"):
                out += self._block_delta("thinking", thought)
            if text := delta.get("content"):
                out += self._block_delta("text", text)
            for call in delta.get("tool_calls") or []:
                out += self._close_text()
                block = _tool_block(call)
                partial = json.dumps(block["input"], ensure_ascii=False)
                index, self._blocks, self._used_tools = self._blocks, self._blocks + 1, True
                out += [
                    {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                    {"type": "content_block_delta", "index": index, "delta": _json_delta(partial)},
                    {"type": "content_block_stop", "index": index},
                ]
        return out

    def chunks(self, text: str, logprobs: tuple = (), tokens: int | None = None) -> list[dict]:
        return self._start() + self._deltas(self._answer.feed(text))

    def add(self, event: TokenEvent) -> None:
        """Nothing to keep: Messages answers carry no logprobs."""

    def final_chunks(self, final: FinalEvent) -> list[dict]:
        out = self._start(final) + self._deltas(self._answer.finish())
        out += self._close_text()
        reason, stop = self._stop_reason(final)
        return out + [
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": stop},
                "usage": self._usage(final),
            },
            {"type": "message_stop"},
        ]

    def error_chunks(self, error: ApiError) -> list[dict]:
        """The error object as the stream's last event."""
        return [error.body(self.shape)]

    def body(self, text: str, final: FinalEvent) -> dict:
        thought, content, calls = self.plan.parse(text)
        blocks = [_thinking_block(thought)] if thought else []
        blocks += [_text_block(content)] if content else []
        blocks += [_tool_block(c) for c in calls]
        self._used_tools = bool(calls)
        return self._message(blocks, final)


def _text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def _thinking_block(thinking: str) -> dict:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _text_delta(text: str) -> dict:
    return {"type": "text_delta", "text": text}


def _json_delta(partial: str) -> dict:
    return {"type": "input_json_delta", "partial_json": partial}


def _tool_block(call: dict) -> dict:
    """Anthropic's ``tool_use`` block of a parsed call (the chat route's shape)."""
    fn = call["function"]
    return {
        "type": "tool_use",
        "id": f"toolu_{secrets.token_hex(12)}",
        "name": fn["name"],
        "input": json.loads(fn["arguments"]),
    }


@router.post("/messages", responses={**ERRORS, 200: {"content": {"text/event-stream": {}}}})
async def messages(body: MessagesRequest, request: Request, state: State):
    """Anthropic's Messages API: the answer as a ``message`` (text and ``tool_use`` blocks), or
    with ``stream`` as Anthropic's named server-sent events; ``tools`` with ``input_schema``,
    ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``), ``stop_sequences``,
    ``temperature``, ``top_p``, ``top_k``. Errors in Anthropic's shape.

    ``usage`` counts as Anthropic's prompt caching does (its total prompt is ``input_tokens +
    cache_read_input_tokens + cache_creation_input_tokens``): ``cache_read_input_tokens`` the
    prompt tokens whose keys and values came from stepserve's prefix cache, ``input_tokens``
    those prefilled, ``cache_creation_input_tokens`` 0 (prefixes are cached by themselves; a
    ``cache_control`` on a block is accepted and changes nothing, the output included). In
    ``message_start``, in the last ``message_delta`` (the whole usage, as Anthropic sends it
    there) and in the message."""
    engine, ids, planned = await _prompt(body, state)
    params = pipeline.sampling_params(
        engine,
        len(ids),
        body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=tuple(body.stop_sequences or ()),
        grammar=pipeline.grammar(engine, None, planned.lark, "tools"),
    )
    plan = pipeline.answer_plan(state, engine, planned.form, ids)
    gen = pipeline.start(state, engine, ids, params, keep_special=plan.keep_special)
    fmt = MessagesFormat(engine.model.name, len(ids), plan, cached=lambda: gen.seq.cached_tokens)
    return await pipeline.respond(request, gen, fmt, body.stream)


@router.post("/messages/count_tokens", response_model=TokenCount, responses=ERRORS)
async def count_tokens(body: MessagesInput, state: State) -> TokenCount:
    """The prompt tokens ``/v1/messages`` would prefill for the same body (same template,
    tools included), without generating."""
    _, ids, _ = await _prompt(body, state)
    return TokenCount(input_tokens=len(ids))
