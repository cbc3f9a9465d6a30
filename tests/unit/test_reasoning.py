"""The reasoning and tool call parsers on real output text, whole and split at every chunk
boundary: ``<think>`` splitting, gpt-oss Harmony outputs recorded in openai/harmony's own docs
and tests (docs/format.md, tests/test_harmony.py), Qwen XML and Mistral calls; and which
request controls a model's template can honour."""

from __future__ import annotations

import json

import pytest

from service.api.reasoning import AnswerPlan, resolve, template_controls
from service.api.tools import ToolChoice, parse_tool_calls, plan, tool_call_form

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def streamed(plan_: AnswerPlan, text: str, cuts: list[int]) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, [(name, arguments)]) of ``text`` fed in pieces cut at ``cuts``."""
    stream, deltas, at = plan_.stream(), [], 0
    for cut in [*cuts, len(text)]:
        deltas += stream.feed(text[at:cut])
        at = cut
    deltas += stream.finish()
    calls = [
        (d["tool_calls"][0]["function"]["name"], d["tool_calls"][0]["function"]["arguments"])
        for d in deltas
        if "tool_calls" in d
    ]
    return (
        "".join(d.get("reasoning_content", "") for d in deltas),
        "".join(d.get("content", "") for d in deltas),
        calls,
    )


def every_split(plan_: AnswerPlan, text: str, expected: tuple) -> None:
    """The whole-text parse and the stream at every one and two cut points agree with ``expected``."""
    thought, content, calls = plan_.parse(text)
    whole = (thought or "", content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    assert whole == expected
    for i in range(len(text)):
        assert streamed(plan_, text, [i]) == expected, i
    for i in range(0, len(text), 7):
        for j in range(i, len(text), 5):
            assert streamed(plan_, text, [i, j]) == expected, (i, j)


def test_think_tags_split_at_any_boundary():
    text = "<think>\nThe user greets.\n</think>\n\nHello!"
    every_split(AnswerPlan("think", None), text, ("The user greets.\n", "Hello!", []))
    # the prompt opened <think> (DeepSeek-R1): the output starts as reasoning
    every_split(AnswerPlan("think", None, thinking=True), "Greets.</think>\n\nHi", ("Greets.", "Hi", []))
    # a Hermes call after the reasoning is a call; one inside it is reasoning
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"<think>maybe <tool_call></think>\n<tool_call>\n{call}\n</tool_call>"
    every_split(AnswerPlan("think", "hermes"), text, ("maybe <tool_call>", "", [("get_weather", '{"city": "Paris"}')]))


# Recorded gpt-oss outputs (the text after the prompt's "<|start|>assistant"), from openai/harmony.
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}'
)
HARMONY_RECIPIENT_FIRST = (
    "<|channel|>analysis<|message|>User asks: “What is the weather in SF?” We need to use lookup_weather tool.<|end|>"
    "<|start|>assistant to=functions.lookup_weather<|channel|>commentary <|constrain|>json<|message|>"
    '{"location": "San Francisco"}'
)
HARMONY_ADJACENT = (
    '<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{"latitude":48.8566,"longitude":2.3522}'
)
HARMONY_FINAL = (
    "<|channel|>analysis<|message|>User asks: 2+2. Simple.<|end|><|start|>assistant<|channel|>final<|message|>"
    "2 + 2 = 4."
)


def test_harmony_recorded_outputs():
    tools = AnswerPlan("harmony", "harmony")
    every_split(
        tools,
        HARMONY_CALL,
        ("Need to use function get_weather.", "", [("get_weather", '{"location": "San Francisco"}')]),
    )
    thought = "User asks: “What is the weather in SF?” We need to use lookup_weather tool."
    every_split(tools, HARMONY_RECIPIENT_FIRST, (thought, "", [("lookup_weather", '{"location": "San Francisco"}')]))
    every_split(tools, HARMONY_ADJACENT, ("", "", [("get_weather", '{"latitude": 48.8566, "longitude": 2.3522}')]))
    every_split(AnswerPlan("harmony", None), HARMONY_FINAL, ("User asks: 2+2. Simple.", "2 + 2 = 4.", []))
    assert AnswerPlan("harmony", None).keep_special and not AnswerPlan("think", "hermes").keep_special


QWEN_XML = (
    "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>"
)


def test_qwen_xml_calls_at_any_boundary():
    expected = ("", "Let me check.", [("get_weather", '{"city": "New York", "days": 3}'), ("now", "{}")])
    every_split(AnswerPlan(None, "qwen_xml"), QWEN_XML, expected)
    # not a call (no <function=...>): stays in the content as written
    assert parse_tool_calls("<tool_call>\nhello\n</tool_call>", "qwen_xml") == ("<tool_call>\nhello\n</tool_call>", [])


@pytest.mark.parametrize(
    "form,text",
    [
        (
            "mistral",
            'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "now", "arguments": {}}]',
        ),
        ("mistral_args", 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}'),
    ],
)
def test_mistral_calls_at_any_boundary(form, text):
    every_split(AnswerPlan(None, form), text, ("", "Checking.", [("get_weather", '{"city": "Paris"}'), ("now", "{}")]))
    broken = "Checking. [TOOL_CALLS]not json"
    every_split(AnswerPlan(None, form), broken, ("", broken, []))


def test_forms_and_parsers_are_read_from_the_template():
    assert tool_call_form("{{ tools }}<tool_call>\n<function={{ name }}>") == "qwen_xml"
    assert tool_call_form("{{ tools }}[TOOL_CALLS]{{ call.name }}[ARGS]") == "mistral_args"
    assert tool_call_form("{{ tools }}[TOOL_CALLS] [{{ calls|tojson }}]") == "mistral"
    assert tool_call_form("{{ tools }}<|channel|>commentary") == "harmony"
    assert resolve("auto", "<|start|>assistant<|channel|>") == "harmony"
    assert resolve("auto", "{% if enable_thinking %}<think>{% endif %}") == "think"
    assert (
        resolve("auto", "{{ m }}") is None and resolve("none", "<think>") is None and resolve("think", None) == "think"
    )


def test_required_calls_refused_where_the_grammar_cannot_force_the_form():
    for template in ("{{ tools }}<function=", "{{ tools }}<|channel|>"):
        for choice in (ToolChoice("required"), ToolChoice("function", "get_weather")):
            with pytest.raises(ValueError, match="^tool_choice: "):
                plan([WEATHER], choice, template)
    mistral = plan([WEATHER], ToolChoice("function", "get_weather"), "{{ tools }}[TOOL_CALLS][ARGS]")
    assert mistral.lark is not None and '"[TOOL_CALLS]get_weather[ARGS]"' in mistral.lark


def test_template_controls_honour_what_the_template_takes_and_name_the_field_otherwise():
    gpt_oss = "{{ reasoning_effort }}<|channel|>"
    assert template_controls("harmony", gpt_oss, "high", "reasoning_effort") == {"reasoning_effort": "high"}
    qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}"
    assert template_controls("think", qwen3, "none", "reasoning.effort") == {"enable_thinking": False}
    assert template_controls("think", qwen3, "medium", "reasoning.effort") == {"enable_thinking": True}
    assert template_controls(None, "", "none", "reasoning_effort") == {}
    for parser, template, effort in (("think", qwen3, "high"), (None, "", "low"), ("harmony", gpt_oss, "none")):
        with pytest.raises(ValueError, match="^reasoning_effort: "):
            template_controls(parser, template, effort, "reasoning_effort")  # type: ignore[arg-type]
    assert json.dumps(template_controls("think", "<think>", None, "x")) == "{}"


def _pieces(tokens: list[str]) -> list[tuple[str, int]]:
    """One piece per token, with the output tokens through it (as TokenEvent.tokens counts)."""
    return [(t, i + 1) for i, t in enumerate(tokens)]


def _counted(plan_: AnswerPlan, pieces: list[tuple[str, int]], total: int) -> int:
    """The streamed count, checked against the whole-answer count."""
    stream = plan_.stream()
    for text, tokens in pieces:
        stream.feed(text, tokens)
    stream.finish(total)
    assert plan_.reasoning_tokens(pieces, total) == stream.reasoning_tokens
    return stream.reasoning_tokens


def test_reasoning_tokens_run_through_the_closing_think_tag():
    tokens = ["<think>", "The", " user", " greets", ".", "</think>", "\n\n", "Hello", "!"]
    think = AnswerPlan("think", None)
    assert _counted(think, _pieces(tokens), len(tokens) + 1) == 6  # + the stop token: not reasoning
    # several tokens in one piece (an incomplete UTF-8 character held back): counted with it
    merged = [("<think>The", 2), (" user greets", 4), (".</think>", 6), ("\n\nHello!", 9)]
    assert _counted(think, merged, 10) == 6
    # the prompt opened <think>: the output starts as reasoning
    assert _counted(AnswerPlan("think", None, thinking=True), _pieces(["Greets", ".", "</think>", "Hi"]), 5) == 3
    # the output limit ended it inside the reasoning: every token, the last one with no text yet too
    assert _counted(think, _pieces(["<think>", "Hmm", "m"]), 4) == 4
    # no reasoning at all, or no parser
    assert _counted(think, _pieces(["Hello", "!"]), 3) == 0
    assert _counted(AnswerPlan(None, None), _pieces(tokens), 10) == 0


def test_harmony_reasoning_tokens_are_the_analysis_messages_header_to_end():
    analysis = ["<|channel|>", "analysis", "<|message|>", "User", " asks", ".", "<|end|>"]
    final = ["<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "4", "."]
    assert _counted(AnswerPlan("harmony", None), _pieces(analysis + final), 15) == len(analysis)
    # a call on the commentary channel after the reasoning is not reasoning
    call = ["<|start|>", "assistant", "<|channel|>", "commentary to=functions.f", "<|message|>", "{}"]
    assert _counted(AnswerPlan("harmony", "harmony"), _pieces(analysis + call), 14) == len(analysis)
    # a Harmony model's calls read without a reasoning parser: nothing is counted
    assert _counted(AnswerPlan(None, "harmony"), _pieces(analysis + call), 14) == 0
