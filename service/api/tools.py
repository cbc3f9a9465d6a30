"""OpenAI tool calls for chat: checking ``tools``/``tool_choice``, putting tools in the prompt,
parsing calls out of the model's whole text, and the grammar that forces calls (the streamed
parser: :mod:`service.api.tool_stream`).

The forms of call, chosen by the chat template (:func:`tool_call_form`; docs/TOOL_CALLS.md):

- ``hermes`` (Hermes 2 Pro, Qwen2.5, and the fallback prompt of templates without tools)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``llama3`` (Llama 3.1/3.2): the whole answer is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several calls separated by ``;``.

- ``qwen_xml`` (Qwen3-Coder, Qwen3.5): Hermes' tags around XML, one parameter a tag, its value
  raw text (JSON where it parses as JSON, else a string)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

- ``mistral``: ``[TOOL_CALLS]`` then the calls to the end of the text, as a JSON list
  ``[{"name": ..., "arguments": {...}}]`` (Mistral 7B v0.3, Nemo) or as ``name[ARGS]{...}``,
  each call after its own ``[TOOL_CALLS]`` (templates that write ``[ARGS]``: Mistral Small 3.2,
  Devstral, Magistral). ``[TOOL_CALLS]`` is a special token: these models' text keeps them.
- ``harmony`` (gpt-oss): a message to ``functions.NAME`` whose body is the arguments; parsed
  with the reasoning by :mod:`service.api.harmony`.

Everything here is plain text work (no MLX, no llguidance); grammars are Lark text in
llguidance's syntax, compiled by the engine's grammar module.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from models.tokenizer import ChatTokenizer, tool_arguments

Form = Literal["hermes", "llama3", "qwen_xml", "mistral", "mistral_args", "harmony"]
# Forms whose markers are special tokens: the answer's text keeps special tokens.
SPECIAL_MARKERS: frozenset[str] = frozenset({"mistral", "mistral_args", "harmony"})
# Forms the grammar cannot force (tool_choice "required" or a named function answers 400).
UNFORCED: frozenset[str] = frozenset({"qwen_xml", "harmony"})
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_XML_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)(?:</function>\s*)?$", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# How llguidance lays out JSON in forced calls: the separators of Python's json.dumps (and of
# the templates' ``tojson``), no free whitespace; keywords it cannot enforce are skipped.
_JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", ", "lenient": True}

FALLBACK_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
FALLBACK_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's checked tools do to it (:func:`plan`): ``rendered`` goes to the
    chat template (None: no tools in the prompt), answers are parsed for calls in ``form``
    (None: not parsed), and ``lark`` forces calls (None: the model may answer freely)."""

    rendered: list[dict[str, Any]] | None = None
    form: Form | None = None
    lark: str | None = None


@dataclass(frozen=True)
class ToolChoice:
    """A checked ``tool_choice``: ``function`` names the one tool (``name``) the model must call."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None


# ---------------------------------------------------------------- checking the request


def validate_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's ``tools`` as plain dicts in OpenAI's shape, ``parameters`` filled in
    (a function without parameters takes an empty object, as in OpenAI's API).

    Raises:
        ValueError: naming the field, e.g. ``tools.0.function.parameters: not a JSON schema
            object`` or ``tools.1.function.name: duplicate tool name 'f'``.
    """
    out, seen = [], set()
    for i, tool in enumerate(tools or ()):
        where = f"tools.{i}"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ValueError(f"{where}.type: must be 'function'")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ValueError(f"{where}.function: must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name: must be 1 to 64 letters, digits, '_' or '-'")
        if name in seen:
            raise ValueError(f"{where}.function.name: duplicate tool name '{name}'")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = dict(_NO_PARAMETERS)
        if not isinstance(params, Mapping):
            raise ValueError(f"{where}.function.parameters: not a JSON schema object")
        if params.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters: type must be 'object' (arguments are an object)")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description: must be a string")
        function = {"name": name, **({"description": description} if description else {}), "parameters": params}
        out.append({"type": "function", "function": function})
    return out


def validate_tool_choice(tool_choice: str | Mapping[str, Any] | None, tools: Sequence[Mapping]) -> ToolChoice:
    """``tool_choice`` checked against ``tools`` (as :func:`validate_tools` returns them).
    Unset means ``auto`` with tools and ``none`` without, as in OpenAI's API.

    Raises:
        ValueError: naming the field, e.g. ``tool_choice.function.name: no tool named 'x'``.
    """
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice("auto" if names else "none")
    if tool_choice in ("none", "required"):
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs at least one tool in 'tools'")
        return ToolChoice(tool_choice)  # type: ignore[arg-type]  # narrowed by the test above
    if not isinstance(tool_choice, Mapping):
        raise ValueError('tool_choice: must be "none", "auto", "required" or {"type": "function", "function": ...}')
    if tool_choice.get("type") != "function":
        raise ValueError("tool_choice.type: must be 'function'")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice.function.name: required")
    if name not in names:
        raise ValueError(f"tool_choice.function.name: no tool named '{name}'")
    return ToolChoice("function", name)


def plan(tools: Sequence[Mapping[str, Any]], choice: ToolChoice, chat_template: str | None) -> ToolPlan:
    """The :class:`ToolPlan` of checked ``tools`` (:func:`validate_tools`) and ``choice``
    (:func:`validate_tool_choice`) for a model with ``chat_template``: ``none`` leaves the tools
    out of the prompt and the answer unparsed; else the form comes from the template
    (:func:`tool_call_form`) and ``required``/named choices get :func:`tool_grammar`.

    Raises:
        ValueError: ``tool_choice: ...`` for ``required`` or a named function in a form the
            grammar cannot force (:data:`UNFORCED`: Qwen's XML, whose values are raw text, and
            Harmony, whose markers are special tokens).
    """
    if choice.mode == "none":
        return ToolPlan()
    form = tool_call_form(chat_template)
    if form in UNFORCED and choice.mode in ("required", "function"):
        what = "'required'" if choice.mode == "required" else "a named function"
        raise ValueError(
            f"tool_choice: {what} cannot be enforced for this model's tool call format ({form}); use 'auto'"
        )
    return ToolPlan([dict(t) for t in tools] or None, form, tool_grammar(tools, choice, form))


# ---------------------------------------------------------------- the prompt


def supports_tools(chat_template: str | None) -> bool:
    """Whether the template renders ``tools`` itself (its source mentions the variable)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template or "") is not None


def tool_call_form(chat_template: str | None) -> Form:
    """The form the model calls tools in, read from its template: ``harmony`` where it writes
    ``<|channel|>``; ``qwen_xml`` where it writes ``<function=``; ``mistral_args`` where it
    writes ``[TOOL_CALLS]`` and ``[ARGS]``, ``mistral`` where only ``[TOOL_CALLS]``; ``hermes``
    where it mentions ``<tool_call>``; ``llama3`` for Llama 3.1-style templates (they mention
    ``<|python_tag|>`` or ``"parameters"``); else ``hermes`` (other tool templates, and the
    fallback prompt)."""
    t = chat_template or ""
    if not supports_tools(t):
        return "hermes"
    if "<|channel|>" in t:
        return "harmony"
    if "<function=" in t:
        return "qwen_xml"
    if TOOL_CALLS in t:
        return "mistral_args" if ARGS in t else "mistral"
    if OPEN in t:
        return "hermes"
    return "llama3" if PYTHON_TAG in t or '"parameters"' in t else "hermes"


def fallback_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that describes ``tools`` to a model whose template has no tools
    (Qwen2.5's wording; one tool per line as JSON)."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return FALLBACK_HEADER + lines + FALLBACK_FOOTER


def hermes_block(name: str, arguments: Any) -> str:
    """One call in the Hermes form; ``arguments`` a dict or a JSON string."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': tool_arguments(arguments)}, ensure_ascii=False)}\n{CLOSE}"


def fallback_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None) -> list[dict]:
    """``messages`` for a template without tools: the :func:`fallback_prompt` appended to the
    system message (or as one, first), assistant ``tool_calls`` as Hermes blocks after the
    text, and each run of ``tool`` messages as one ``user`` turn of
    ``<tool_response>\\n...\\n</tool_response>`` blocks."""
    out: list[dict] = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):  # text parts
            content = "".join(p.get("text") or "" for p in content)
        if m.get("role") == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_run"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_run": True})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = [hermes_block(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([content, *blocks] if content else blocks)})
        else:
            out.append({"role": m.get("role"), "content": content})
    for m in out:
        m.pop("_tool_run", None)
    if tools:
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + fallback_prompt(tools)
        else:
            out.insert(0, {"role": "system", "content": fallback_prompt(tools)})
    return out


def render_messages(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """The prompt for ``messages`` (dicts with text or None content, ``tool`` roles, assistant
    ``tool_calls``) and ``tools``: through the template when it supports tools, else through
    :func:`fallback_messages`. Pass ``tools=None`` for ``tool_choice: "none"``. ``variables``:
    further template variables (:func:`service.api.reasoning.template_controls`).

    Raises:
        TokenizerError: no chat template, or the template failed.
    """
    if supports_tools(tokenizer.chat_template):
        return tokenizer.apply_chat_template(
            [dict(m) for m in messages], tools=[dict(t) for t in tools] if tools else None, **(variables or {})
        )
    return tokenizer.apply_chat_template(fallback_messages(messages, tools), **(variables or {}))


# ---------------------------------------------------------------- parsing


def _call(obj: Any) -> dict | None:
    """An OpenAI tool call from a parsed ``{"name", "arguments" | "parameters"}`` object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = tool_arguments(obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(args, dict):
        return None
    function = {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": function}


def block_calls(body: str, form: Form = "hermes") -> list[dict] | None:
    """The calls in one ``<tool_call>`` block's body (an object or a list of them; in the
    ``qwen_xml`` form one ``<function=...>`` element), or None."""
    if form == "qwen_xml":
        call = _xml_call(body)
        return [call] if call is not None else None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    calls = [_call(o) for o in (parsed if isinstance(parsed, list) else [parsed])]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def _xml_value(raw: str) -> Any:
    """A Qwen XML parameter's value: its text less the newline on each side, as JSON where it
    parses as JSON (numbers, booleans, objects, lists, null), else the text itself."""
    text = raw.removeprefix("\n").removesuffix("\n")
    try:
        return json.loads(text)
    except ValueError:
        return text


def _xml_call(body: str) -> dict | None:
    """The call in a Qwen XML block's body (``<function=NAME>`` and its ``<parameter=...>``s), or None."""
    found = _XML_FUNCTION.match(body)
    if found is None:
        return None
    parameters = _XML_PARAMETER.findall(found.group(2))
    if not parameters and found.group(2).strip():
        return None
    return _call({"name": found.group(1), "arguments": {name: _xml_value(value) for name, value in parameters}})


def mistral_calls(text: str) -> list[dict] | None:
    """The calls after a ``[TOOL_CALLS]`` marker (``text`` starts after it): a JSON list (or
    object) of ``{"name", "arguments"}``, or ``name[ARGS]{...}`` (an optional ``[CALL_ID]id``
    before ``[ARGS]``) for each ``[TOOL_CALLS]`` in turn; None if any piece is not a call."""
    calls: list[dict] = []
    for piece in text.split(TOOL_CALLS):
        piece = piece.strip()
        if not piece:
            continue
        if piece[0] in "[{":
            parsed = block_calls(piece)
        elif ARGS in piece:
            name, arguments = piece.split(ARGS, 1)
            name = name.split(CALL_ID, 1)[0].strip()
            try:
                args = json.loads(arguments)
            except ValueError:
                return None
            parsed = [c] if (c := _call({"name": name, "arguments": args})) is not None else None
        else:
            return None
        if parsed is None:
            return None
        calls += parsed
    return calls or None


def _llama3_calls(text: str) -> list[dict] | None:
    """The calls when all of ``text`` is ``[<|python_tag|>]{call}[; {call}...]``, else None."""
    rest = text.strip()
    rest = rest[len(PYTHON_TAG) :].lstrip() if rest.startswith(PYTHON_TAG) else rest
    calls, decoder = [], json.JSONDecoder()
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
        except ValueError:
            return None
        if (call := _call(obj)) is None:
            return None
        calls.append(call)
        rest = rest[end:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
    return calls or None


def parse_tool_calls(text: str, form: Form) -> tuple[str | None, list[dict]]:
    """Split generated text into (content, tool calls in OpenAI's shape).

    Hermes: every ``<tool_call>...</tool_call>`` block (a last one may be unclosed) whose body
    is a call's JSON becomes a call; a block that is not (invalid JSON, no name, arguments not
    an object) stays in the content as it was written. Whitespace next to a parsed call is
    dropped. Qwen XML: the same blocks, each one ``<function=...>`` element. Llama 3: the whole
    text is calls or none of it is. Mistral: the text from the first ``[TOOL_CALLS]`` on is
    calls, or none of it is. (Harmony: :mod:`service.api.harmony`.)

    Returns:
        ``(text, [])`` unchanged when no call parsed; else ``(other text or None, calls)``.
    """
    if form == "llama3":
        calls = _llama3_calls(text) if may_be_llama3(text) else None
        return (None, calls) if calls else (text, [])
    if form in ("mistral", "mistral_args"):
        at = text.find(TOOL_CALLS)
        calls = mistral_calls(text[at + len(TOOL_CALLS) :]) if at >= 0 else None
        return (text[:at].rstrip() or None, calls) if calls else (text, [])
    texts, runs = [""], []  # texts[k] comes before runs[k]: the text between parsed blocks
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        stop = len(text) if end < 0 else end + len(CLOSE)
        calls = block_calls(text[start + len(OPEN) : end if end >= 0 else len(text)], form)
        texts[-1] += text[pos:start]
        if calls:
            runs.append(calls)
            texts.append("")
        else:
            texts[-1] += text[start:stop]
        pos = stop
    texts[-1] += text[pos:]
    if not runs:
        return text, []
    content = "".join(_strip(t, lead=k > 0, trail=k < len(runs)) for k, t in enumerate(texts))
    return content or None, [c for run in runs for c in run]


def _strip(piece: str, lead: bool, trail: bool) -> str:
    piece = piece.lstrip() if lead else piece
    return piece.rstrip() if trail else piece


def may_be_llama3(text: str) -> bool:
    """Whether ``text`` (so far) may still be Llama 3 calls: empty after leading whitespace,
    ``{...``, or ``<|python_tag|>`` (or a start of it). Once False, False for any longer text."""
    rest = text.lstrip()
    return rest.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(rest)


def _call_schema(tool: Mapping[str, Any], form: Form) -> dict[str, Any]:
    """JSON schema of one call of ``tool``: its name as a constant, its arguments as its
    ``parameters`` (their ``$defs``/``definitions`` moved to the root so ``$ref`` resolves)."""
    fn = tool["function"]
    params = {k: v for k, v in (fn.get("parameters") or _NO_PARAMETERS).items() if k not in ("$schema", "$id")}
    defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    if not any(k in params for k in ("type", "anyOf", "oneOf", "allOf", "$ref")):
        params["type"] = "object"
    key = "parameters" if form == "llama3" else "arguments"
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, key: params},
        "required": ["name", key],
        "additionalProperties": False,
        **defs,
        "x-guidance": _JSON_LAYOUT,
    }


def tool_grammar(tools: Sequence[Mapping[str, Any]], choice: ToolChoice, form: Form) -> str | None:
    """A Lark grammar (llguidance's dialect, JSON schemas as ``%json {...}``) that forces the
    answer to be tool calls, then the end of the text; None for ``none`` and ``auto``.

    ``required``: one or more Hermes blocks joined by ``\n`` (one Llama 3 call), each naming
    any tool; ``function``: exactly one call of that tool. Mistral: ``[TOOL_CALLS]`` and a
    JSON list of calls (one for a named function), or ``[TOOL_CALLS]name[ARGS]{...}`` calls in
    the ``mistral_args`` form. Arguments follow the tool's
    ``parameters``, laid out as ``json.dumps`` does (``", "``, ``": "``, no other whitespace);
    schema keywords llguidance cannot enforce are skipped (its ``lenient`` option).
    """
    if choice.mode in ("none", "auto"):
        return None
    chosen = [t for t in tools if choice.mode == "required" or t["function"]["name"] == choice.name]
    if form == "mistral_args":
        return _mistral_args_grammar(chosen, many=choice.mode == "required")
    rules = [f"call_{i}: %json {json.dumps(_call_schema(t, form), ensure_ascii=False)}" for i, t in enumerate(chosen)]
    alternatives = " | ".join(f"call_{i}" for i in range(len(chosen)))
    if form == "llama3":
        start = "start: call"
    elif form == "mistral":
        start = 'start: "[TOOL_CALLS][" call ' + ('(", " call)* ' if choice.mode == "required" else "") + '"]"'
    elif choice.mode == "required":
        start = 'start: block ("\\n" block)*\nblock: "<tool_call>\\n" call "\\n</tool_call>"'
    else:
        start = 'start: "<tool_call>\\n" call "\\n</tool_call>"'
    return "\n".join([start, f"call: {alternatives}", *rules]) + "\n"


def _mistral_args_grammar(chosen: Sequence[Mapping[str, Any]], many: bool) -> str:
    """The grammar of ``[TOOL_CALLS]name[ARGS]{...}`` calls of the ``chosen`` tools (one, or
    ``many``: one or more), arguments after each tool's ``parameters``."""
    rules = []
    for i, tool in enumerate(chosen):
        schema = _call_schema(tool, "hermes")
        arguments = {**schema["properties"]["arguments"], "x-guidance": _JSON_LAYOUT}
        arguments.update({k: v for k, v in schema.items() if k in ("$defs", "definitions")})
        name = json.dumps(f"{TOOL_CALLS}{tool['function']['name']}{ARGS}")
        rules.append(f"call_{i}: {name} %json {json.dumps(arguments, ensure_ascii=False)}")
    start = "start: call+" if many else "start: call"
    return "\n".join([start, "call: " + " | ".join(f"call_{i}" for i in range(len(chosen))), *rules]) + "\n"
