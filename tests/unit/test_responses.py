"""The Responses route's pieces without a server: the conversation it renders, the events and
response object it answers, and the store behind previous_response_id (the route itself runs
in tests/e2e/test_responses.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from service.api import pipeline
from service.api.errors import ApiError
from service.api.reasoning import AnswerPlan
from service.api.response_store import ResponseStore
from service.api.responses import ResponsesFormat, conversation, output_turns, skeleton
from service.api.schemas import ResponsesRequest
from service.api.tools import hermes_block, parse_tool_calls
from service.engine.sequence import FinalEvent, FinishReason, TokenEvent
from tests.support import FinishedGeneration


def _final(reason: FinishReason, completion: int = 5, error: str | None = None) -> FinalEvent:
    return FinalEvent(reason, 12, completion, 0.0, 0.1, 0.2, 0.3, error=error)


def _input(items) -> str | list:
    return ResponsesRequest.model_validate({"input": items}).input


def test_items_become_the_chat_routes_turns_in_order():
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}", "id": "fc_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "function_call", "call_id": "call_3", "name": "get_time", "arguments": "{}"},
    ]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}, "id": "call_1"}
    time_call = {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    assert conversation(_input(items)) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call, {**time_call, "id": "call_2"}]},
        {"role": "tool", "content": "rain", "tool_call_id": "call_1"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2"},
        {"role": "assistant", "content": None, "tool_calls": [{**time_call, "id": "call_3"}]},
    ]
    assert conversation(_input("Hi")) == [{"role": "user", "content": "Hi"}]


def test_reasoning_items_sent_back_are_accepted_and_left_out_of_the_prompt():
    """Codex CLI sends its reasoning items back; the templates drop past reasoning, so does the route."""
    items = [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"role": "assistant", "content": "Hello"},
    ]
    assert conversation(_input(items)) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]


@pytest.mark.parametrize(
    "items,param",
    [
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}], "input.0.content.0.type"),
        ([{"type": "item_reference", "id": "msg_1"}], "input.0.type"),
        (
            [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}],
            "input.0.output.0.type",
        ),
    ],
)
def test_what_cannot_be_rendered_answers_400_naming_it(items, param):
    with pytest.raises(ApiError) as raised:
        conversation(_input(items))
    assert raised.value.status == 400 and raised.value.param == param


def _stream(fmt: ResponsesFormat, pieces: list[str], final: FinalEvent) -> list[dict]:
    return [e for p in pieces for e in fmt.chunks(p)] + fmt.final_chunks(final)


def _format(body: dict | None = None, form=None, kept: list | None = None) -> ResponsesFormat:
    request = ResponsesRequest.model_validate({"input": "Hi", **(body or {})})
    return ResponsesFormat(skeleton(request, "m"), AnswerPlan(None, form), kept.append if kept is not None else None)


def test_a_streamed_text_and_function_call_add_up_to_the_whole_response():
    text = "Let me check. " + hermes_block("get_weather", {"city": "Paris"})
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]  # split inside the markup too
    kept: list[dict] = []
    events = _stream(_format(form="hermes", kept=kept), pieces, _final(FinishReason.STOP))
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added"] + [
        "response.content_part.added"
    ]
    assert kinds[-8:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",  # the message closes before the call opens
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    content, calls = parse_tool_calls(text, "hermes")
    assert streamed == content == final["output"][0]["content"][0]["text"]
    message, call = final["output"]
    assert (message["type"], message["status"], call["type"], call["status"]) == (
        "message",
        "completed",
        "function_call",
        "completed",
    )
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert json.loads(call["arguments"]) == json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]
    whole = _format(form="hermes").body(text, _final(FinishReason.STOP))
    kinds = [(o["type"], o["status"]) for o in whole["output"]]
    assert kinds == [("message", "completed"), ("function_call", "completed")]
    assert whole["output"][0]["content"] == message["content"] and whole["output"][1]["name"] == "get_weather"
    assert (
        whole["usage"]
        == final["usage"]
        == {
            "input_tokens": 12,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 5,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 17,
        }
    )
    assert kept == [final] and final["status"] == "completed"


def test_the_output_limit_makes_the_response_incomplete():
    events = _stream(_format({"max_output_tokens": 2}), ["Par", "is"], _final(FinishReason.LENGTH, 2))
    end = events[-1]
    assert end["type"] == "response.incomplete" and end["response"]["status"] == "incomplete"
    assert end["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert end["response"]["output"][0]["status"] == "incomplete" and end["response"]["max_output_tokens"] == 2
    whole = _format().body("Paris", _final(FinishReason.LENGTH))
    assert whole["status"] == "incomplete" and whole["output"][0]["status"] == "incomplete"
    empty = _format().final_chunks(_final(FinishReason.STOP, 0))  # no text at all: one empty message
    assert empty[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_the_output_sent_back_is_the_turn_the_store_keeps():
    text = "Checking. " + hermes_block("get_weather", {"city": "Paris"})
    response = _format(form="hermes").body(text, _final(FinishReason.STOP))
    assert conversation(_input(response["output"])) == output_turns(response["output"])
    plain = _format().body("Paris.", _final(FinishReason.STOP))
    assert output_turns(plain["output"]) == [{"role": "assistant", "content": "Paris."}]


def test_the_request_is_echoed_as_openai_echoes_it():
    body = {
        "input": "Hi",
        "instructions": "Be brief.",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "store": False,
        "metadata": {"k": "v"},
        "temperature": 0,
    }
    out = skeleton(ResponsesRequest.model_validate(body), "m")
    assert out["id"].startswith("resp_") and out["object"] == "response" and out["status"] == "in_progress"
    assert out["tools"] == body["tools"] and out["tool_choice"] == body["tool_choice"]
    assert out["text"]["format"] == body["text"]["format"] and out["store"] is False and out["metadata"] == {"k": "v"}
    assert (out["instructions"], out["temperature"], out["top_p"]) == ("Be brief.", 0.0, 1.0)
    defaults = skeleton(ResponsesRequest.model_validate({"input": "Hi"}), "m")
    assert defaults["tool_choice"] == "auto" and defaults["store"] is True
    assert defaults["text"]["format"] == {"type": "text"} and defaults["max_output_tokens"] is None


def _frames(fmt: ResponsesFormat, final: FinalEvent) -> list[dict]:
    async def frames() -> list[str]:
        return [f async for f in pipeline._sse(FinishedGeneration(final), fmt, TokenEvent("Hi", 1))]  # type: ignore[arg-type]

    out = []
    for frame in "".join(asyncio.run(frames())).split("\n\n")[:-1]:
        head, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"  # each event named on its own line
        out.append(event)
    return out


def test_a_stream_names_its_events_and_a_failure_ends_it_with_error_and_response_failed():
    kept: list[dict] = []
    events = _frames(_format(kept=kept), _final(FinishReason.ERROR, error="the engine failed"))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "the engine failed" and events[-2]["code"] == "500"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": "the engine failed"}
    assert [e["sequence_number"] for e in events] == list(range(len(events))) and kept == []
    done = _frames(_format(), _final(FinishReason.STOP, 1))
    assert done[-1]["type"] == "response.completed" and not any(e["type"] == "error" for e in done)


def _response(i: int, text: str = "x" * 100) -> dict:
    return {"id": f"resp_{i}", "output": text}


def test_the_store_keeps_what_fits_and_evicts_the_least_recently_used():
    one = ResponseStore(10_000)
    assert one.put(_response(0), [{"role": "user", "content": "Hi"}])
    size = one.nbytes
    store = ResponseStore(3 * size)
    for i in range(3):
        assert store.put(_response(i), [{"role": "user", "content": "Hi"}])
    assert len(store) == 3 and store.nbytes == 3 * size
    assert store.get("resp_0") is not None  # now the most recently used
    store.put(_response(3), [{"role": "user", "content": "Hi"}])
    assert store.get("resp_1") is None and store.get("resp_0") is not None and len(store) == 3
    assert not store.put(_response(4, "y" * 4 * size), []) and store.get("resp_4") is None  # larger than the store
    store.put(_response(0, "short"), [])  # the same id again replaces it
    entry = store.get("resp_0")
    assert entry is not None and entry.response["output"] == "short" and store.nbytes < 3 * size
    assert store.pop("resp_0") is entry and store.get("resp_0") is None
    nothing = ResponseStore(0)
    assert not nothing.put(_response(0), []) and len(nothing) == 0


def test_usage_counts_cached_prompt_tokens_and_reasoning_tokens_streamed_and_whole():
    tokens = ["<think>", "Greets", ".", "</think>", "\n\n", "Hi", "!"]
    final = FinalEvent(FinishReason.STOP, 40, len(tokens) + 1, 0.0, 0.1, 0.2, 0.3, cached_tokens=32)
    request = ResponsesRequest.model_validate({"input": "Hi"})
    streamed = ResponsesFormat(skeleton(request, "m"), AnswerPlan("think", None))
    events = [e for i, t in enumerate(tokens) for e in streamed.chunks(t, (), i + 1)] + streamed.final_chunks(final)
    whole = ResponsesFormat(skeleton(request, "m"), AnswerPlan("think", None))
    for i, t in enumerate(tokens):
        whole.add(TokenEvent(t, i, (), i + 1))
    body = whole.body("".join(tokens), final)
    expected = {
        "input_tokens": 40,
        "input_tokens_details": {"cached_tokens": 32},
        "output_tokens": 8,
        "output_tokens_details": {"reasoning_tokens": 4},  # <think> through </think>
        "total_tokens": 48,
    }
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["usage"] == expected
    assert body["usage"] == expected and body["output"][0]["type"] == "reasoning"
