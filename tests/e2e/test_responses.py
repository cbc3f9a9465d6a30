"""OpenAI's Responses API through the official `openai` client (and plain HTTP where the client
would hide the wire) against a real `stepserve serve` of the default model."""

from __future__ import annotations

import json
import uuid
from typing import Any

import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = "You are a helpful assistant. Answer in one sentence."
ASK = "What is the capital of France?"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": WEATHER_SCHEMA,
    "strict": True,
}
WEATHER_ASK = {"role": "user", "content": "What is the weather in Paris?"}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def chat(server, **body) -> dict:
    with server.client() as http:
        reply = http.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_greedy_create_and_stream_match_chat_completions(server):
    c = client(server)
    args = dict(model=MODEL, instructions=INSTRUCTIONS, input=ASK, max_output_tokens=16, temperature=0)
    whole = c.responses.create(**args, metadata={"trace": "t1"}, user="u1")
    events = list(c.responses.create(**args, stream=True))
    turns = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK}]
    reference = chat(server, max_tokens=16, messages=turns)
    answer = reference["choices"][0]
    assert whole.output_text and whole.output_text == answer["message"]["content"]
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == MODEL
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    status = {"stop": "completed", "length": "incomplete"}[answer["finish_reason"]]
    assert whole.status == message.status == status and whole.metadata == {"trace": "t1"}
    assert whole.usage is not None and whole.usage.input_tokens == reference["usage"]["prompt_tokens"]
    assert whole.usage.output_tokens == reference["usage"]["completion_tokens"]
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    opening = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[:4] == opening and kinds[-4:-1] == closing and kinds[-1] == f"response.{status}"
    assert kinds[4:-4] == ["response.output_text.delta"] * (len(kinds) - 8) and len(kinds) > 9
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text == whole.output_text
    assert final.usage == whole.usage and final.id != whole.id


def test_a_repeated_long_instruction_is_read_from_the_prefix_cache_streamed_and_not(server):
    rules = " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(12))
    instructions = f"Session {uuid.uuid4().hex}. You are a careful travel assistant. {rules}"  # new to the server
    c = client(server)
    args: dict[str, Any] = dict(
        model=MODEL, instructions=instructions, input=ASK, max_output_tokens=4, temperature=0, store=False
    )
    first, again = c.responses.create(**args), c.responses.create(**args)
    completed: list[Any] = [
        e for e in c.responses.create(**args, stream=True) if e.type in ("response.completed", "response.incomplete")
    ]
    assert first.usage is not None and first.usage.input_tokens >= 160  # several 32-token blocks
    assert first.usage.input_tokens_details.cached_tokens == 0
    for usage in (again.usage, completed[0].response.usage):
        assert usage is not None and usage.input_tokens == first.usage.input_tokens
        assert 128 <= usage.input_tokens_details.cached_tokens < usage.input_tokens, usage
        assert usage.output_tokens_details.reasoning_tokens == 0  # the default model does not reason
    assert again.output_text == first.output_text == completed[0].response.output_text


def test_the_wire_names_each_event_and_the_output_limit_makes_it_incomplete(server):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 3, "temperature": 0, "stream": True}
    with server.client() as http, http.stream("POST", "/v1/responses", json=body) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        frames = [frame for frame in reply.read().decode().split("\n\n") if frame]
    events = [dict(line.split(": ", 1) for line in frame.split("\n")) for frame in frames]
    assert all(json.loads(e["data"])["type"] == e["event"] for e in events)
    assert [e["event"] for e in events][-2:] == ["response.output_item.done", "response.incomplete"]
    end = json.loads(events[-1]["data"])["response"]
    assert end["status"] == "incomplete" and end["incomplete_details"] == {"reason": "max_output_tokens"}
    assert end["usage"]["output_tokens"] == 3 and end["output"][0]["status"] == "incomplete"
    short = client(server).responses.create(model=MODEL, input=ASK, max_output_tokens=3, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"
    assert short.output_text == end["output"][0]["content"][0]["text"]


def test_a_forced_function_call_validates_streams_alike_then_its_output_gets_a_text_answer(server):
    c = client(server)
    args = dict(model=MODEL, input=[WEATHER_ASK], tools=[WEATHER], max_output_tokens=64, temperature=0)
    called = c.responses.create(**args, tool_choice={"type": "function", "name": "get_weather"})
    calls = [o for o in called.output if o.type == "function_call"]
    assert called.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and (call.id or "").startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    events = list(c.responses.create(**args, tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    streamed = [o for o in events[-1].response.output if o.type == "function_call"]
    assert deltas == done.arguments == streamed[0].arguments == call.arguments and streamed[0].name == call.name
    follow = c.responses.create(
        model=MODEL,
        input=[
            WEATHER_ASK,
            *called.output,
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"},
        ],
        tools=[WEATHER],
        max_output_tokens=24,
        temperature=0,
    )
    assert follow.output_text and all(o.type == "message" for o in follow.output)


def test_text_format_json_schema_output_validates(server):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "country": {"type": "string", "maxLength": 16}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    answer = client(server).responses.create(
        model=MODEL,
        input="Name a city and its country as JSON.",
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
        max_output_tokens=48,
        temperature=0,
    )
    assert answer.status == "completed", answer.output_text
    jsonschema.validate(json.loads(answer.output_text), schema)
    assert answer.text is not None and answer.text.format is not None and answer.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation_and_store_false_keeps_nothing(server):
    c = client(server)
    first = c.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=ASK, max_output_tokens=16, temperature=0)
    again = "And of Germany?"
    follow = c.responses.create(
        model=MODEL, previous_response_id=first.id, input=again, max_output_tokens=16, temperature=0
    )
    # instructions are not carried over (as OpenAI does): the follow-up sees the turns only
    turns = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": again},
    ]
    assert follow.output_text == chat(server, max_tokens=16, messages=turns)["choices"][0]["message"]["content"]
    assert follow.previous_response_id == first.id and follow.output_text
    kept = c.responses.retrieve(first.id)
    assert kept.id == first.id and kept.output_text == first.output_text and kept.usage == first.usage
    alone = c.responses.create(model=MODEL, input=ASK, max_output_tokens=2, temperature=0, store=False)
    assert alone.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(alone.id)
    with pytest.raises(openai.BadRequestError) as refused:
        c.responses.create(model=MODEL, previous_response_id=alone.id, input=again, max_output_tokens=2)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]


IMAGE = {"type": "input_image", "image_url": "https://example.com/cat.png"}
BAD = [
    ({"input": [{"role": "user", "content": [IMAGE]}]}, 400, "input.0.content.0.type"),
    ({"reasoning": {"effort": "high"}}, 400, "reasoning.effort"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"tools": [{**WEATHER, "parameters": {"type": "string"}}]}, 400, "tools.0.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name"),
    ({"tools": [WEATHER], "parallel_tool_calls": False}, 400, "parallel_tool_calls"),
    ({"include": ["message.output_text.logprobs"]}, 400, "include.0"),
    ({"previous_response_id": "resp_unknown"}, 400, "previous_response_id"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"background": True}, 400, "background"),
    ({"text": {"verbosity": "low"}}, 400, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 422, "text.format"),
    ({"max_output_tokens": 0}, 422, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"input": []}, 422, "input"),
    ({"model": "no-such-model"}, 404, "model"),
]


@pytest.mark.parametrize("change,status,field", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_input_answers_openai_errors_naming_the_field_and_serving_goes_on(server, change, status, field):
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 2, **change}
    with server.client() as http:
        reply = http.post("/v1/responses", json=body)
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == str(status)
        assert error["param"] == field, error
        assert (
            http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}).status_code == 200
        )


def test_requests_are_counted_and_an_unknown_id_is_not_found(server):
    c = client(server)
    ok, not_found = (
        server.metric("stepserve_requests_total", status="200"),
        server.metric("stepserve_requests_total", status="404"),
    )
    c.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="no-such-model", input="Hi", max_output_tokens=2)
    assert server.metric("stepserve_requests_total", status="200") == ok + 1
    assert server.metric("stepserve_requests_total", status="404") == not_found + 1
    with pytest.raises(openai.NotFoundError) as missing:
        c.responses.retrieve("resp_never")
    assert missing.value.status_code == 404
