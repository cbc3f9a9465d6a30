"""`stepserve bench routes` without a model: the requests each route gets, and what is read from
each route's recorded stream events (tokens from its own usage field, arrivals from its deltas,
failures kept as errors), through httpx's mock transport."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from service.bench.common import openai_event, stream_request
from service.bench.load import Workload
from service.bench.routes import (
    PATHS,
    TOOLS,
    checked,
    load_figures,
    messages_body,
    messages_event,
    responses_body,
    responses_event,
    route_plan,
    route_request,
    run_load,
    schedule,
)

MODEL = "m"


def chat_body(max_tokens: int = 7) -> dict:
    """A chat body of the bench's conversations: a shared system prompt and one user turn."""
    _, body = Workload("chat-shared-prefix", max_tokens=max_tokens, system_tokens=40).request(0)
    return {**body, "model": MODEL}


def sse(events: list[dict], named: bool) -> bytes:
    """Server-sent events as the route writes them (Messages and Responses name each event)."""
    frames = [(f"event: {e['type']}\n" if named else "") + f"data: {json.dumps(e)}\n\n" for e in events]
    return "".join(frames).encode() + (b"" if named else b"data: [DONE]\n\n")


# In the shapes stepserve's routes write them (service/api/anthropic.py, responses.py), trimmed:
# a text answer cut by the output limit, and on Messages a tool call after the text.
MESSAGES_STREAM = [
    {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "usage": {
                "input_tokens": 7,  # Anthropic's: the prompt tokens neither read from nor written to the cache
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 24,
                "output_tokens": 0,
            },
        },
    },
    {"type": "ping"},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "The"}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " weather"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "name": "get_weather"}},
    {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"city"'}},
    {"type": "content_block_stop", "index": 1},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}},
    {"type": "message_stop"},
]
RESPONSES_STREAM = [
    {"type": "response.created", "sequence_number": 0, "response": {"status": "in_progress", "usage": None}},
    {"type": "response.in_progress", "sequence_number": 1, "response": {"usage": None}},
    {"type": "response.output_item.added", "sequence_number": 2, "item": {"type": "message"}},
    {"type": "response.content_part.added", "sequence_number": 3, "part": {"type": "output_text", "text": ""}},
    {"type": "response.output_text.delta", "sequence_number": 4, "delta": "Hello", "logprobs": []},
    {"type": "response.output_text.delta", "sequence_number": 5, "delta": " there", "logprobs": []},
    {"type": "response.output_text.done", "sequence_number": 6, "text": "Hello there"},
    {
        "type": "response.incomplete",
        "sequence_number": 7,
        "response": {
            "status": "incomplete",
            "usage": {"input_tokens": 29, "input_tokens_details": {"cached_tokens": 16}, "output_tokens": 6},
        },
    },
]
CHAT_STREAM = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
    {"choices": [{"index": 0, "delta": {"content": "!"}}]},
    {"choices": [], "usage": {"prompt_tokens": 25, "completion_tokens": 5, "total_tokens": 30}},
]
STREAMS = {"/v1/chat/completions": CHAT_STREAM, "/v1/messages": MESSAGES_STREAM, "/v1/responses": RESPONSES_STREAM}


def transport(streams: dict[str, list[dict]], seen: list[tuple[str, dict]] | None = None) -> httpx.MockTransport:
    """Each path streams its recorded events; a path given an int answers that status instead."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if seen is not None:
            seen.append((request.url.path, body))
        events = streams[request.url.path]
        if isinstance(events, int):
            return httpx.Response(events, json={"error": {"message": "bad", "param": "input"}})
        named = request.url.path != "/v1/chat/completions"
        return httpx.Response(200, content=sse(events, named), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def read(path: str, events: list[dict], parse):
    async def go():
        async with httpx.AsyncClient(base_url="http://bench", transport=transport({path: events})) as client:
            return await stream_request(client, path, {}, parse=parse)

    return asyncio.run(go())


def test_route_plan_gives_each_route_its_streams_spread_over_the_indices():
    plan = route_plan(8, 2, 2)
    assert [plan.count(r) for r in ("messages", "responses", "chat")] == [2, 2, 4]
    for route in ("messages", "responses", "chat"):  # none has all its streams at the start or the end
        first = [i for i, r in enumerate(plan) if r == route]
        assert first[0] < 4 <= first[-1]
    assert route_plan(3, 0, 0) == ["chat"] * 3
    assert route_plan(2, 2, 0) == ["messages"] * 2
    with pytest.raises(ValueError, match="3 messages \\+ 2 responses streams of 4"):
        route_plan(4, 3, 2)


def test_messages_body_is_the_chat_conversation_with_tools_and_auto_choice():
    chat = chat_body()
    system, user = chat["messages"]
    body = messages_body(chat)
    assert body["system"] == system["content"] and body["messages"] == [user]
    assert (body["max_tokens"], body["temperature"], body["stream"], body["model"]) == (7, 0, True, MODEL)
    assert body["tool_choice"] == {"type": "auto"} and 1 <= len(body["tools"]) <= 2
    for tool in body["tools"]:
        assert tool["name"] and tool["input_schema"]["type"] == "object" and tool["input_schema"]["required"]
    assert route_request("messages", chat) == ("/v1/messages", body)


def test_responses_body_is_the_chat_conversation_as_instructions_and_input():
    chat = chat_body()
    system, user = chat["messages"]
    body = responses_body(chat)
    assert body["instructions"] == system["content"] and body["input"] == user["content"]
    assert (body["max_output_tokens"], body["temperature"], body["stream"], body["model"]) == (7, 0, True, MODEL)
    assert "tools" not in body and "max_tokens" not in body
    more = {**chat, "messages": [user, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}
    multi = responses_body(more)
    assert "instructions" not in multi and [(i["type"], i["role"]) for i in multi["input"]] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert route_request("chat", chat) == ("/v1/chat/completions", chat)


def test_each_route_counts_its_own_usage_field_and_times_its_deltas():
    messages = read("/v1/messages", MESSAGES_STREAM, messages_event)
    # message_start's output_tokens (0) is not the answer's count; message_delta's is
    assert messages.usage == {
        "prompt_tokens": 31,
        "prompt_tokens_details": {"cached_tokens": 24},
        "completion_tokens": 9,
    }
    assert messages.prompt_tokens == 31 and messages.cached_tokens == 24  # the whole prompt, 24 of it cached
    assert messages.tokens == 9 and len(messages.arrivals) == 3  # two text deltas and the tool call's JSON
    responses = read("/v1/responses", RESPONSES_STREAM, responses_event)
    assert responses.tokens == 6 and responses.prompt_tokens == 29 and responses.cached_tokens == 16
    assert len(responses.arrivals) == 2
    chat = read("/v1/chat/completions", CHAT_STREAM, openai_event)
    assert chat.tokens == 5 and chat.prompt_tokens == 25 and len(chat.arrivals) == 2
    for record in (messages, responses, chat):
        assert record.error is None and record.counted and checked(record).error is None
        assert record.start <= record.arrivals[0] <= record.arrivals[-1] <= record.end
        assert record.ttft_s is not None and len(record.gaps) == len(record.arrivals) - 1


def test_a_stream_without_its_usage_or_with_an_error_event_is_an_error():
    no_usage = read("/v1/messages", MESSAGES_STREAM[:-2], messages_event)  # cut before message_delta
    assert (no_usage.usage or {}).get("prompt_tokens") == 31 and not no_usage.counted and no_usage.tokens == 3
    assert checked(no_usage).error == "missing usage: the stream ended after 3 deltas without its token count"
    completed_without = [*RESPONSES_STREAM[:-1], {"type": "response.completed", "response": {"usage": None}}]
    assert str(checked(read("/v1/responses", completed_without, responses_event)).error).startswith("missing usage")
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    failed = read("/v1/messages", [*MESSAGES_STREAM[:4], overloaded], messages_event)
    assert "overloaded_error" in str(failed.error)
    errored = [
        *RESPONSES_STREAM[:5],
        {"type": "error", "code": "500", "message": "engine stopped", "param": None},
        {"type": "response.failed", "response": {"status": "failed", "error": {"code": "server_error"}}},
    ]
    assert "engine stopped" in str(read("/v1/responses", errored, responses_event).error)


def test_a_load_sends_each_stream_through_its_route_and_reports_each_route_apart():
    seen: list[tuple[str, dict]] = []
    workload = Workload("chat-shared-prefix", max_tokens=7, system_tokens=40)
    routes = ["messages", "chat", "responses", "chat"]
    results, elapsed = asyncio.run(run_load("http://bench", routes, 2, workload, MODEL, transport(STREAMS, seen)))
    assert elapsed > 0 and len(results) == len(seen) == 8
    assert sorted(path for path, _ in seen) == sorted(PATHS[r] for r in routes * 2)
    users = [b["messages"][-1]["content"] if "messages" in b else b["input"] for _, b in seen]
    assert len(set(users)) == 8  # a conversation of its own per request
    assert all(b["model"] == MODEL for _, b in seen)
    assert all(b["tools"] == list(TOOLS) for p, b in seen if p == "/v1/messages")
    figures = load_figures(results, elapsed)
    assert figures["errors"] == 0 and figures["requests"] == 8
    tokens = {"chat": 5, "messages": 9, "responses": 6}
    for route, per in tokens.items():
        f = figures["routes"][route]
        n = 2 * routes.count(route)
        assert (f["requests"], f["errors"], f["completion_tokens"]) == (n, 0, n * per)
        assert f["aggregate_tok_s"] == pytest.approx(n * per / elapsed) and f["error_reasons"] == {}
    assert figures["completion_tokens"] == sum(2 * routes.count(r) * n for r, n in tokens.items())


def test_failed_requests_count_as_errors_of_their_route_with_reasons_and_add_no_tokens():
    streams = {**STREAMS, "/v1/responses": 400, "/v1/messages": MESSAGES_STREAM[:-2]}
    workload = Workload("chat-shared-prefix", max_tokens=7, system_tokens=40)
    routes = ["messages", "chat", "responses"]
    figures = load_figures(*asyncio.run(run_load("http://bench", routes, 2, workload, MODEL, transport(streams))))
    assert (figures["requests"], figures["errors"], figures["completion_tokens"]) == (2, 4, 2 * 5)
    responses, messages = figures["routes"]["responses"], figures["routes"]["messages"]
    assert (responses["requests"], responses["errors"], responses["completion_tokens"]) == (0, 2, 0)
    (reason,) = responses["error_reasons"]
    assert reason.startswith("http_400: ") and "input" in reason and responses["error_reasons"][reason] == 2
    assert messages["errors"] == 2 and list(messages["error_reasons"]) == [
        "missing usage: the stream ended after 3 deltas without its token count"
    ]


def test_a_transport_error_or_an_event_that_is_not_json_is_an_error_of_its_route():
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/messages":
            raise httpx.ConnectError("refused")
        return httpx.Response(200, content=b"data: {not json\n\n", headers={"content-type": "text/event-stream"})

    workload = Workload("chat-shared-prefix", max_tokens=7, system_tokens=40)
    done = asyncio.run(run_load("http://bench", ["messages", "chat"], 1, workload, MODEL, httpx.MockTransport(handle)))
    routes = load_figures(*done)["routes"]
    assert routes["messages"]["error_reasons"] == {"ConnectError: refused": 1}
    ((reason, n),) = routes["chat"]["error_reasons"].items()
    assert reason.startswith("JSONDecodeError: ") and n == 1


def test_rounds_alternate_which_load_goes_first():
    assert schedule(3) == [("all-chat", "mixed"), ("mixed", "all-chat"), ("all-chat", "mixed")]
