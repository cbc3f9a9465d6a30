"""Anthropic's Messages API through the official `anthropic` client (and plain HTTP where the
client would hide the wire) against a real `stepserve serve` of the default model.

The client's newest releases dropped ``temperature`` from ``messages.create``; the tests send it
with ``extra_body``, which works with every release."""

from __future__ import annotations

import json
import uuid
from typing import Any

import anthropic
import jsonschema
import pytest

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"extra_body": {"temperature": 0}}
SYSTEM = "You are a helpful assistant. Answer in one sentence."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(server, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600, **kwargs)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def chat(server, **body) -> dict:
    with server.client() as http:
        reply = http.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_greedy_create_and_stream_match_chat_completions_and_count_tokens(server):
    c = client(server)
    args = dict(model=MODEL, max_tokens=24, system=SYSTEM, messages=ASK, metadata={"user_id": "u1"}, **GREEDY)
    whole = c.messages.create(**args)
    with c.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    reference = chat(server, max_tokens=24, messages=[{"role": "system", "content": SYSTEM}, *ASK])
    answer = reference["choices"][0]
    assert text_of(whole) and text_of(whole) == text_of(streamed) == answer["message"]["content"]
    assert whole.id.startswith("msg_") and whole.role == "assistant" and whole.model == MODEL
    reason = {"stop": "end_turn", "length": "max_tokens"}[answer["finish_reason"]]
    assert whole.stop_reason == streamed.stop_reason == reason and whole.stop_sequence is None
    prompt = [u.input_tokens + (u.cache_read_input_tokens or 0) for u in (whole.usage, streamed.usage)]
    assert prompt == [reference["usage"]["prompt_tokens"]] * 2  # the prompt, however much came from the cache
    assert whole.usage.output_tokens == streamed.usage.output_tokens == reference["usage"]["completion_tokens"]
    counted = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == prompt[0]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def long_system() -> str:
    """A system prompt of several prefix-cache blocks (32 tokens each), new to the server (its
    first words are unique, so no earlier request shares even its first block)."""
    rules = " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(12))
    return f"Session {uuid.uuid4().hex}. You are a careful travel assistant. {rules}"


def test_a_repeated_long_system_prompt_is_read_from_the_prefix_cache_streamed_and_not(server):
    c = client(server)
    args: dict[str, Any] = dict(model=MODEL, max_tokens=4, system=long_system(), messages=ASK, **GREEDY)
    first = c.messages.create(**args)
    again = c.messages.create(**args)
    with c.messages.stream(**args) as stream:
        start = next(e for e in stream if e.type == "message_start")
        streamed = stream.get_final_message()
    prompt = c.messages.count_tokens(model=MODEL, system=args["system"], messages=args["messages"]).input_tokens
    assert prompt >= 160  # the system prompt spans several 32-token blocks
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens == prompt
    for usage in (again.usage, start.message.usage, streamed.usage):
        assert usage.cache_read_input_tokens is not None and usage.cache_read_input_tokens >= 128, usage
        assert usage.input_tokens + usage.cache_read_input_tokens == first.usage.input_tokens, usage
        assert usage.cache_creation_input_tokens == 0
    assert streamed.usage.cache_read_input_tokens == start.message.usage.cache_read_input_tokens
    assert text_of(again) == text_of(streamed) == text_of(first)  # the cache changes nothing in the answer
    # a cache_control breakpoint is accepted and changes nothing (the prefix cache works by itself)
    marked = [{"type": "text", "text": args["system"], "cache_control": {"type": "ephemeral"}}]
    hinted = c.messages.create(**{**args, "system": marked})
    assert (
        text_of(hinted) == text_of(first)
        and hinted.usage.input_tokens + (hinted.usage.cache_read_input_tokens or 0) == prompt
    )


def test_stream_on_the_wire_names_each_event_in_order(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, "stream": True, "temperature": 0}
    with server.client() as http, http.stream("POST", "/v1/messages", json=body) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        frames = [frame for frame in reply.read().decode().split("\n\n") if frame]
    events = [dict(line.split(": ", 1) for line in frame.split("\n")) for frame in frames]
    names = [e["event"] for e in events]
    assert all(json.loads(e["data"])["type"] == e["event"] for e in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[3:-3] == ["content_block_delta"] * (len(names) - 6)
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    end = json.loads(events[-2]["data"])
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and end["usage"]["output_tokens"] == 4


def test_forced_tool_call_validates_then_a_tool_result_gets_a_text_answer(server):
    c = client(server)
    called = c.messages.create(
        model=MODEL,
        max_tokens=80,
        messages=WEATHER_ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        **GREEDY,
    )
    assert called.stop_reason == "tool_use"
    (use,) = [b for b in called.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    follow = c.messages.create(
        model=MODEL,
        max_tokens=24,
        tools=[WEATHER],
        messages=[
            *WEATHER_ASK,
            {"role": "assistant", "content": called.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees"}]},
        ],
        **GREEDY,
    )
    assert follow.stop_reason in ("end_turn", "max_tokens") and text_of(follow)
    assert all(b.type == "text" for b in follow.content)


def test_streamed_any_tool_call_arrives_as_input_json_deltas(server):
    c = client(server)
    args = dict(model=MODEL, max_tokens=80, messages=WEATHER_ASK, tools=[WEATHER], tool_choice={"type": "any"})
    with c.messages.stream(**args, **GREEDY) as stream:
        deltas = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and uses and len(deltas) == len(uses)
    for use in uses:
        jsonschema.validate(use.input, WEATHER["input_schema"])
    whole = c.messages.create(**args, **GREEDY)
    assert [(u.name, u.input) for u in uses] == [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
    counted = c.messages.count_tokens(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER], tool_choice={"type": "any"})
    without_tools = c.messages.count_tokens(model=MODEL, messages=WEATHER_ASK)
    usage = whole.usage  # the streamed request's prompt is in the prefix cache now: Anthropic counts it apart
    prompt_tokens = usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    assert (usage.cache_read_input_tokens or 0) > 0
    assert counted.input_tokens == prompt_tokens > without_tools.input_tokens


def test_stop_sequences_and_max_tokens_set_the_stop_reason(server):
    c = client(server)
    free = c.messages.create(model=MODEL, max_tokens=24, messages=ASK, **GREEDY)
    words = text_of(free).split()
    assert len(words) >= 3, text_of(free)
    stop = " " + words[2]  # a stop string the greedy answer holds
    cut = c.messages.create(model=MODEL, max_tokens=24, messages=ASK, stop_sequences=[stop, "never seen"], **GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert text_of(cut) == text_of(free)[: text_of(free).index(stop)]
    with c.messages.stream(model=MODEL, max_tokens=24, messages=ASK, stop_sequences=[stop], **GREEDY) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, text_of(streamed)) == ("stop_sequence", stop, text_of(cut))
    short = c.messages.create(model=MODEL, max_tokens=2, messages=ASK, **GREEDY)
    assert (short.stop_reason, short.usage.output_tokens) == ("max_tokens", 2)
    assert text_of(free).startswith(text_of(short))


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
BAD = [
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, 400, "messages.0.content.0.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
    ({"container": "c1"}, 400, "container"),
    ({"max_tokens": None}, 400, "max_tokens"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, 400, "messages.0.role"),
    ({"messages": [*ASK, {"role": "assistant", "content": "The"}]}, 400, "messages.1.role"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "tool_choice.name"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, 400, "tools.0.input_schema"),
    ({"stop_sequences": [""]}, 400, "stop_sequences"),
    ({"model": "no-such-model"}, 404, "model"),
]


@pytest.mark.parametrize("change,status,field", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_input_answers_anthropic_errors_naming_the_field_and_serving_goes_on(server, change, status, field):
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, **change}
    with server.client() as http:
        reply = http.post("/v1/messages", json={k: v for k, v in body.items() if v is not None})
        assert reply.status_code == status, reply.text
        error = reply.json()
        assert (
            set(error) == {"type", "error"} and error["type"] == "error" and set(error["error"]) == {"type", "message"}
        )
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        assert error["error"]["type"] == kind and field in error["error"]["message"], error
        assert http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ASK}).status_code == 200


def test_the_client_raises_its_own_errors_and_requests_are_counted(server):
    c = client(server)
    with pytest.raises(anthropic.NotFoundError) as raised:
        c.messages.create(model="no-such-model", max_tokens=2, messages=ASK)
    assert raised.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [IMAGE]}])
    ok, not_found = (
        server.metric("stepserve_requests_total", status="200"),
        server.metric("stepserve_requests_total", status="404"),
    )
    c.messages.create(model=MODEL, max_tokens=2, messages=ASK, extra_headers={"anthropic-version": "2099-01-01"})
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="no-such-model", max_tokens=2, messages=ASK)
    assert server.metric("stepserve_requests_total", status="200") == ok + 1
    assert server.metric("stepserve_requests_total", status="404") == not_found + 1
