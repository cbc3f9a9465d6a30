"""Tool calls: checking requests, prompts (the default model's fallback, Qwen- and Llama 3.1-like
templates), parsing whole and streamed text, and the grammars that force calls (llguidance)."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from models.default import default_model_path
from models.gguf.reader import read_gguf
from models.gguf.vocab import tokenizer_from_gguf
from models.tokenizer import ChatTokenizer, TokenizerError
from service.api.tool_stream import ToolCallStream
from service.api.tools import (
    FALLBACK_FOOTER,
    FALLBACK_HEADER,
    ToolChoice,
    fallback_prompt,
    hermes_block,
    parse_tool_calls,
    render_messages,
    supports_tools,
    tool_call_form,
    tool_grammar,
    validate_tool_choice,
    validate_tools,
)

# The tool sections of Qwen2.5's template (Hermes form), trimmed.
QWEN_LIKE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are Qwen.{% endif %}

# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}{{ "\\n" }}{{ tool | tojson }}{% endfor %}{{ "\\n" }}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant' }}{% if message.content %}{{ '\\n' + message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson }}{{ '}\\n</tool_call>' }}
{%- endfor %}{{ '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}{{ '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{ '<|im_end|>\\n' }}{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""

# The custom-tool sections of Llama 3.1's template (tools in the first user message), trimmed.
LLAMA31_LIKE = """{{- bos_token }}
{%- if not tools is defined %}{% set tools = none %}{% endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{ "Environment: ipython\\n" }}{% endif %}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
{%- set first_user_message = messages[0]['content']|trim %}{% set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
{{- "Do not use variables.\\n\\n" }}
{%- for t in tools %}{{ t | tojson(indent=4) }}{{ "\\n\\n" }}{% endfor %}
{{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls|length == 1 %}{{ raise_exception("only single tool-calls at once") }}{% endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{ tool_call.arguments | tojson }}{{ "}<|eot_id|>" }}
{%- else %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
TOOLS = validate_tools([WEATHER, TIME])

CALL_DICT = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL_DICT]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    _, metadata = read_gguf(default_model_path())
    return tokenizer_from_gguf(metadata)


def with_template(tok: ChatTokenizer, template: str) -> ChatTokenizer:
    return ChatTokenizer(tok.tokenizer, template, tok.bos_token_id, tok.eos_token_id, False, tok.stop_token_ids)


# ---------------------------------------------------------------- requests


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([{"type": "retrieval"}], "tools.0.type: must be 'function'"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools.0.function.name: must be"),
        ([WEATHER, WEATHER], "tools.1.function.name: duplicate tool name 'get_weather'"),
        ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tools.0.function.parameters: not a"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "parameters: type"),
    ],
)
def test_bad_tools_name_the_field(tools, message):
    with pytest.raises(ValueError, match=message):
        validate_tools(tools)


def test_tool_choice_is_checked_against_the_tools():
    assert validate_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert validate_tool_choice(None, []) == ToolChoice("none")
    assert validate_tool_choice("required", TOOLS) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert validate_tool_choice(named, TOOLS) == ToolChoice("function", "get_time")
    with pytest.raises(ValueError, match="tool_choice.function.name: no tool named 'x'"):
        validate_tool_choice({"type": "function", "function": {"name": "x"}}, TOOLS)
    with pytest.raises(ValueError, match="tool_choice: 'required' needs at least one tool"):
        validate_tool_choice("required", [])
    with pytest.raises(ValueError, match="tool_choice: must be"):
        validate_tool_choice("always", TOOLS)
    assert TOOLS[1]["function"]["parameters"] == {"type": "object", "properties": {}, "additionalProperties": False}


# ---------------------------------------------------------------- prompts


def test_forms_follow_the_template(tok):
    assert not supports_tools(tok.chat_template) and tool_call_form(tok.chat_template) == "hermes"
    assert supports_tools(QWEN_LIKE) and tool_call_form(QWEN_LIKE) == "hermes"
    assert supports_tools(LLAMA31_LIKE) and tool_call_form(LLAMA31_LIKE) == "llama3"
    assert tool_call_form(None) == "hermes"


def test_default_model_gets_the_fallback_prompt_and_text_tool_turns(tok):
    text = render_messages(tok, [{"role": "system", "content": "Be brief."}, *CONVERSATION], TOOLS)
    prompt = fallback_prompt(TOOLS)
    assert prompt.startswith(FALLBACK_HEADER) and prompt.endswith(FALLBACK_FOOTER)
    assert f"\n{json.dumps(WEATHER)}\n" in prompt
    assert text == (
        f"<|im_start|>system\nBe brief.\n\n{prompt}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # no system message: the tools are one; two tool answers in a row share one user turn
    two = [*CONVERSATION, {"role": "tool", "tool_call_id": "call_2", "content": "windy"}]
    text = render_messages(tok, two, TOOLS)
    assert text.startswith(f"<|im_start|>system\n{prompt}<|im_end|>\n")
    assert "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nwindy\n</tool_response><|im_end|>" in text
    # history with tool turns but no tools in this request: no tool prompt
    assert "# Tools" not in render_messages(tok, CONVERSATION, None)


def test_default_template_without_tools_is_unchanged(tok):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    assert render_messages(tok, messages) == tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    with pytest.raises(TokenizerError, match="chat template failed"):  # null content, no fallback
        tok.apply_chat_template(CONVERSATION[:2])


def test_qwen_like_template_gets_tools_and_parsed_arguments(tok):
    text = render_messages(with_template(tok, QWEN_LIKE), CONVERSATION, TOOLS)
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n{json.dumps(TOOLS[1])}\n</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n" in text
    assert hermes_block("get_weather", '{"city": "Paris"}') in text  # the form the parser reads


def test_llama31_like_template_gets_tools_and_parameters(tok):
    text = render_messages(with_template(tok, LLAMA31_LIKE), CONVERSATION, [WEATHER])
    assert json.dumps(WEATHER, indent=4) in text and "Weather in Paris?<|eot_id|>" in text
    assert '<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n18 C<|eot_id|>" in text
    llama = with_template(tok, LLAMA31_LIKE)
    plain = llama.apply_chat_template([{"role": "user", "content": "hi", "tool_calls": None}])
    assert "Environment" not in plain and "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>" in plain


# ---------------------------------------------------------------- parsing

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {}}'
HERMES_TEXTS = [
    "Just text, no calls.\n",
    f"<tool_call>\n{W}\n</tool_call>",
    f"Let me check.\n\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>\n",
    f"<tool_call>\n{W}\n</tool_call> then <b>done</b>  ",
    "<tool_call>\n{not json}\n</tool_call>",
    f"a <tool_call>{{bad}}</tool_call> b\n<tool_call>{W}</tool_call>",
    f"<tool_call>\n{W}\n",  # unclosed at the end: still a call
    "<tool_call>\n{half",  # unclosed and invalid: text
    "x < y and <tool_ca",
    f'<tool_call>[{W}, {{"name": "get_time", "arguments": "{{}}"}}]</tool_call>',
]
LLAMA3_TEXTS = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
    '  {"name": "get_weather", "parameters": {"city": "Paris"}} and more',
    "The weather is {sunny}.",
    "<|python_ta",
    "",
]
BOTH = [("get_weather", {"city": "Paris"}), ("get_time", {})]


def names(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_parsing():
    assert parse_tool_calls(HERMES_TEXTS[0], "hermes") == (HERMES_TEXTS[0], [])
    content, calls = parse_tool_calls(HERMES_TEXTS[2], "hermes")
    assert content == "Let me check." and names(calls) == BOTH
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    assert parse_tool_calls(HERMES_TEXTS[1], "hermes")[0] is None
    assert parse_tool_calls(HERMES_TEXTS[3], "hermes")[0] == "then <b>done</b>  "
    assert parse_tool_calls(HERMES_TEXTS[4], "hermes") == (HERMES_TEXTS[4], [])  # invalid JSON: content
    content, calls = parse_tool_calls(HERMES_TEXTS[5], "hermes")
    assert content == "a <tool_call>{bad}</tool_call> b" and names(calls) == [("get_weather", {"city": "Paris"})]
    assert names(parse_tool_calls(HERMES_TEXTS[6], "hermes")[1]) == [("get_weather", {"city": "Paris"})]
    assert names(parse_tool_calls(HERMES_TEXTS[9], "hermes")[1]) == BOTH


def test_llama3_parsing():
    content, calls = parse_tool_calls(LLAMA3_TEXTS[0], "llama3")
    assert content is None and names(calls) == [("get_weather", {"city": "Paris"})]
    assert names(parse_tool_calls(LLAMA3_TEXTS[1], "llama3")[1]) == BOTH
    for text in LLAMA3_TEXTS[2:]:
        assert parse_tool_calls(text, "llama3") == (text, [])


def stream(text: str, pieces: list[str], form) -> tuple[str | None, list[dict], list[dict]]:
    parser = ToolCallStream(form)
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [c["index"] for c in calls] == list(range(len(calls))) and len(parser.calls) == len(calls)
    return (content or None) if calls else content, calls, deltas


ALL_TEXTS = [("hermes", t) for t in HERMES_TEXTS] + [("llama3", t) for t in LLAMA3_TEXTS]


@pytest.mark.parametrize(("form", "text"), ALL_TEXTS)
def test_stream_matches_whole_text_at_every_split(form, text):
    whole_content, whole_calls = parse_tool_calls(text, form)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        content, calls, deltas = stream(text, pieces, form)
        assert content == whole_content, pieces
        assert names(calls) == names(whole_calls), pieces
        if whole_calls and form == "hermes" and "bad" not in text:
            assert not any("tool_call" in d.get("content", "") for d in deltas), pieces  # no markup leaks


def test_stream_deltas_have_openai_shape():
    parser = ToolCallStream("hermes")
    deltas = parser.feed("Sure.<tool_") + parser.feed(f"call>\n{W}\n</tool_call>") + parser.finish()
    assert deltas[0] == {"content": "Sure."}
    (call,) = deltas[1]["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert len(deltas) == 2 and parser.calls == [{k: v for k, v in call.items() if k != "index"}]


# ---------------------------------------------------------------- grammars


@pytest.fixture(scope="module")
def ll_tok(tok) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tok.tokenizer.to_str(), eos_token=tok.eos_token_id)


def accepts(tok, ll_tok, grammar: str, text: str) -> bool:
    """Whether ``text`` and then EOS (and nothing else) is what the grammar allows."""
    matcher = llguidance.LLMatcher(ll_tok, llguidance.grammar_from("lark", grammar), log_level=0)
    if not matcher.consume_tokens(tok.tokenizer.encode(text, add_special_tokens=False).ids):
        return False
    if matcher.deep_copy().consume_token(tok.encode(" more")[0]):
        return False  # the answer must end here
    return matcher.consume_token(tok.eos_token_id) and matcher.is_stopped()


def test_no_grammar_for_none_and_auto():
    assert tool_grammar(TOOLS, ToolChoice("auto"), "hermes") is None
    assert tool_grammar(TOOLS, ToolChoice("none"), "llama3") is None


@pytest.mark.parametrize("form", ["hermes", "llama3"])
@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("function", "get_weather")])
def test_grammars_are_valid_llguidance(ll_tok, form, choice):
    grammar = tool_grammar(TOOLS, choice, form)
    assert grammar is not None
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar), ll_tok) == ""


def test_named_function_grammar_forces_one_call_of_it(tok, ll_tok):
    grammar = tool_grammar(TOOLS, ToolChoice("function", "get_weather"), "hermes")
    assert grammar is not None and '"get_time"' not in grammar
    good = hermes_block("get_weather", '{"city": "Paris", "unit": "c"}')
    assert accepts(tok, ll_tok, grammar, good)
    assert parse_tool_calls(good, "hermes")[1]
    assert not accepts(tok, ll_tok, grammar, hermes_block("get_time", "{}"))
    assert not accepts(tok, ll_tok, grammar, hermes_block("get_weather", '{"unit": "c"}'))  # city is required
    assert not accepts(tok, ll_tok, grammar, hermes_block("get_weather", '{"city": "Paris", "unit": "k"}'))
    assert not accepts(tok, ll_tok, grammar, good + "\n" + good)


def test_required_grammar_takes_one_or_more_calls_of_any_tool(tok, ll_tok):
    grammar = tool_grammar(TOOLS, ToolChoice("required"), "hermes")
    assert grammar is not None
    weather, time = hermes_block("get_weather", '{"city": "Oslo"}'), hermes_block("get_time", "{}")
    assert accepts(tok, ll_tok, grammar, weather) and accepts(tok, ll_tok, grammar, f"{time}\n{weather}")
    assert not accepts(tok, ll_tok, grammar, "Sure! " + weather)
    assert not accepts(tok, ll_tok, grammar, hermes_block("get_time", '{"x": 1}'))  # no parameters: {}
    assert not accepts(tok, ll_tok, grammar, "")


def test_llama3_grammar_forces_the_json_form(tok, ll_tok):
    grammar = tool_grammar(TOOLS, ToolChoice("required"), "llama3")
    assert grammar is not None
    good = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert accepts(tok, ll_tok, grammar, good) and parse_tool_calls(good, "llama3")[1]
    assert not accepts(tok, ll_tok, grammar, '{"name": "get_weather", "arguments": {"city": "Paris"}}')


def test_schema_defs_still_resolve_inside_a_call(tok, ll_tok):
    tool = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Point"}},
                "required": ["to"],
                "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
            },
        },
    }
    grammar = tool_grammar(validate_tools([tool]), ToolChoice("function", "move"), "hermes")
    assert grammar is not None
    assert accepts(tok, ll_tok, grammar, hermes_block("move", '{"to": {"x": 3}}'))
    assert not accepts(tok, ll_tok, grammar, hermes_block("move", '{"to": {"x": "3"}}'))


def test_docs_quote_the_fallback_prompt_verbatim():
    docs = (Path(__file__).resolve().parents[2] / "docs/TOOL_CALLS.md").read_text()
    assert FALLBACK_HEADER in docs and FALLBACK_FOOTER in docs
