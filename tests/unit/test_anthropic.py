"""The Anthropic Messages route's pieces without a server: the conversation it renders, the
events and message it answers, and its error shape (the route itself runs in
tests/e2e/test_anthropic_messages.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from service.api import pipeline
from service.api.anthropic import MessagesFormat, conversation, usage
from service.api.errors import ApiError, error_body
from service.api.reasoning import AnswerPlan
from service.api.schemas import MessagesInput
from service.api.tools import hermes_block, parse_tool_calls
from service.engine.sequence import FinalEvent, FinishReason, TokenEvent
from tests.support import FinishedGeneration


def _final(
    reason: FinishReason, completion: int = 5, stop: str | None = None, error: str | None = None, cached: int = 0
) -> FinalEvent:
    return FinalEvent(reason, 12, completion, 0.0, 0.1, 0.2, 0.3, error=error, stop_string=stop, cached_tokens=cached)


def test_blocks_become_the_chat_routes_turns_in_order():
    body = MessagesInput.model_validate(
        {
            "model": "m",
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain", "is_error": True},
                        {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}},
                    ],
                },
            ],
        }
    )
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert conversation(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "content": "Error: rain", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"},
    ]


@pytest.mark.parametrize(
    "messages,param",
    [
        ([{"role": "user", "content": [{"type": "document", "source": {}}]}], "messages.0.content.0.type"),
        (
            [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
            "messages.0.content.0.type",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}],
                }
            ],
            "messages.0.content.0.content.0.type",
        ),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}], "messages.1.role"),
    ],
)
def test_what_cannot_be_rendered_answers_400_naming_it(messages, param):
    with pytest.raises(ApiError) as raised:
        conversation(MessagesInput.model_validate({"model": "m", "messages": messages}))
    assert raised.value.status == 400 and raised.value.param == param


def _stream(fmt: MessagesFormat, pieces: list[str], final: FinalEvent) -> list[dict]:
    return [e for p in pieces for e in fmt.chunks(p)] + fmt.final_chunks(final)


def test_a_streamed_text_and_tool_call_add_up_to_the_whole_message():
    text = "Let me check. " + hermes_block("get_weather", {"city": "Paris"})
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]  # split inside the markup too
    events = _stream(MessagesFormat("m", 12, AnswerPlan(None, "hermes")), pieces, _final(FinishReason.STOP))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    streamed_text = "".join(
        e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
    )
    partial = [e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1] and starts[1]["content_block"]["name"] == "get_weather"
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]  # text closed before the call
    whole = MessagesFormat("m", 12, AnswerPlan(None, "hermes")).body(text, _final(FinishReason.STOP))
    content, calls = parse_tool_calls(text, "hermes")
    assert streamed_text == content == whole["content"][0]["text"]
    assert [json.loads(p) for p in partial] == [json.loads(c["function"]["arguments"]) for c in calls]
    assert whole["content"][1]["input"] == {"city": "Paris"} and whole["content"][1]["id"].startswith("toolu_")
    assert whole["stop_reason"] == events[-2]["delta"]["stop_reason"] == "tool_use"
    no_cache = {"input_tokens": 12, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 5}
    assert whole["usage"] == no_cache


@pytest.mark.parametrize(
    "final,reason,stop",
    [
        (_final(FinishReason.STOP), "end_turn", None),
        (_final(FinishReason.STOP, stop="\n\n"), "stop_sequence", "\n\n"),
        (_final(FinishReason.LENGTH), "max_tokens", None),
    ],
)
def test_stop_reasons(final, reason, stop):
    whole = MessagesFormat("m", 12, AnswerPlan(None, None)).body("Paris", final)
    end = MessagesFormat("m", 12, AnswerPlan(None, None)).final_chunks(final)[-2]
    assert (whole["stop_reason"], whole["stop_sequence"]) == (reason, stop)
    assert end["delta"] == {"stop_reason": reason, "stop_sequence": stop}


def test_a_stream_that_fails_ends_with_an_anthropic_error_event():
    gen = FinishedGeneration(_final(FinishReason.ERROR, error="the engine failed"))

    async def frames() -> list[str]:
        fmt = MessagesFormat("m", 12, AnswerPlan(None, None))
        return [f async for f in pipeline._sse(gen, fmt, TokenEvent("Hi", 1))]  # type: ignore[arg-type]

    out = "".join(asyncio.run(frames())).split("\n\n")
    assert out[0].startswith("event: message_start\n") and out[-1] == ""
    assert (
        out[-2]
        == 'event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": "the engine failed"}}'
    )


def test_error_bodies_in_anthropics_shape_name_the_field():
    assert error_body(422, "Field required", "invalid_request_error", "max_tokens", "anthropic") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    assert error_body(503, "not ready", "unavailable", shape="anthropic")["error"]["type"] == "overloaded_error"
    assert error_body(500, "boom", "server_error", shape="anthropic")["error"]["type"] == "api_error"
    assert error_body(404, "no model", "not_found_error", "model")["error"]["code"] == "404"  # OpenAI's, unchanged


def test_usage_splits_the_prompt_into_prefilled_and_cache_read_tokens_as_anthropic_does():
    # Anthropic: total prompt = input_tokens + cache_read_input_tokens + cache_creation_input_tokens
    for prompt, cached in ((12, 0), (12, 8), (100, 96)):
        got = usage(prompt, cached, 3)
        assert got["input_tokens"] == prompt - cached and got["cache_read_input_tokens"] == cached
        assert got["input_tokens"] + got["cache_read_input_tokens"] + got["cache_creation_input_tokens"] == prompt
        assert got["cache_creation_input_tokens"] == 0 and got["output_tokens"] == 3


def test_a_cache_hit_shows_in_message_start_the_last_message_delta_and_the_message():
    final = _final(FinishReason.STOP, completion=2, cached=8)
    fmt = MessagesFormat("m", 12, AnswerPlan(None, None), cached=lambda: 8)
    events = _stream(fmt, ["Par", "is"], final)
    start, delta = events[0], events[-2]
    assert start["message"]["usage"] == {
        "input_tokens": 4,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 8,
        "output_tokens": 0,
    }
    whole = MessagesFormat("m", 12, AnswerPlan(None, None), cached=lambda: 8).body("Paris", final)
    assert delta["type"] == "message_delta" and delta["usage"] == whole["usage"] == {
        **start["message"]["usage"],
        "output_tokens": 2,
    }


def test_a_request_that_ends_before_its_first_token_starts_with_its_end_figures():
    final = _final(FinishReason.STOP, completion=1, cached=8)  # the stop token came first: no text
    events = MessagesFormat("m", 12, AnswerPlan(None, None), cached=lambda: 0).final_chunks(final)
    assert events[0]["type"] == "message_start" and events[0]["message"]["usage"]["cache_read_input_tokens"] == 8
    assert events[-2]["usage"]["output_tokens"] == 1
