"""Structured outputs, logprobs, tool calls, n > 1, penalties and the request forms clients send,
through the official `openai` client and plain HTTP against a real `stepserve serve` of the
default model."""

import json
import math
import threading

import jsonschema
import pytest
from openai import OpenAI

MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "integer", "minimum": 1000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Describe a person called Ann who lives in Paris as JSON."}]


def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_output_validates_greedy_and_sampled_streamed_and_not(server, temperature):
    c = client(server)
    args = dict(model=MODEL, messages=ASK, response_format=PERSON_FORMAT, max_tokens=300, temperature=temperature)
    whole = c.chat.completions.create(**args, seed=3)
    assert whole.choices[0].finish_reason == "stop", whole.choices[0].message.content
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    stream = c.chat.completions.create(**args, seed=3, stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(streamed), PERSON)
    assert streamed == whole.choices[0].message.content  # same seed, same rows: the same answer


def test_constrained_and_free_rows_share_a_batch(server):
    c = client(server)
    free = dict(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0)
    alone = c.completions.create(**free).choices[0].text
    results: dict = {}

    def constrained(i):
        r = c.chat.completions.create(model=MODEL, messages=ASK, response_format=PERSON_FORMAT, max_tokens=300, seed=i)
        results[f"json{i}"] = r.choices[0].message.content

    def unconstrained(i):
        results[f"free{i}"] = c.completions.create(**free).choices[0].text

    threads = [threading.Thread(target=f, args=(i,)) for i in range(2) for f in (constrained, unconstrained)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        jsonschema.validate(json.loads(results[f"json{i}"]), PERSON)
        assert results[f"free{i}"] == alone
    assert server.metric("stepserve_batch_size_sum", phase="decode") > server.metric(
        "stepserve_batch_size_count", phase="decode"
    )


def test_json_object_on_completions_and_infer(server):
    c = client(server)
    json_mode = {"response_format": {"type": "json_object"}}  # an extension on /v1/completions, as in vLLM
    r = c.completions.create(
        model=MODEL, prompt="A JSON object about a cat:", max_tokens=120, temperature=0, extra_body=json_mode
    )
    assert isinstance(json.loads(r.choices[0].text), dict)
    with server.client() as h:
        body = h.post(
            "/infer",
            json={
                "prompt": "A JSON object about a dog:",
                "max_tokens": 120,
                "response_format": {"type": "json_object"},
            },
        ).json()
    assert isinstance(json.loads(body["text"]), dict)


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_it(server):
    with server.client() as h:
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}}
        r = h.post("/v1/chat/completions", json={"messages": ASK, "response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_top_logprobs_are_sorted_and_the_greedy_token_is_the_top_one(server):
    c = client(server)
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    content = r.choices[0].logprobs.content
    assert content
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and math.isclose(entry.logprob, tops[0], abs_tol=1e-4)
        assert sum(math.exp(t) for t in tops) <= 1.0 + 1e-4
    streamed = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        stream=True,
    )
    tokens = [
        e.token for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content
    ]
    assert tokens == [e.token for e in content]


def test_completion_logprobs_shape_and_echo(server):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=3, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith("The sky is")
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(
        len(t) == 3 and max(t.values()) == pytest.approx(v, abs=1e-4)
        for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )


def test_tool_choice_required_returns_a_call_valid_against_the_schema(server):
    c = client(server)
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r = c.chat.completions.create(
        model=MODEL, messages=ask, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=120, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    # the round trip: the call and its result render through the template
    follow = c.chat.completions.create(
        model=MODEL,
        messages=[
            *ask,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 3}'},
        ],
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_tokens=20,
        temperature=0,
    )
    assert follow.choices[0].message.tool_calls is None and follow.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_named_streams_a_tool_call(server):
    c = client(server)
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Rome please"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    calls, reasons, content = {}, [], ""
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        reasons.append(ch.choices[0].finish_reason)
    assert "<tool_call>" not in content
    assert reasons[-1] == "tool_calls" and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_TOOL["function"]["parameters"])


def test_n_choices_with_a_seed_are_reproducible(server):
    c = client(server)
    args = dict(model=MODEL, prompt="My favourite animal is", max_tokens=10, temperature=1.0, n=3, seed=42)
    first = [ch.text for ch in c.completions.create(**args).choices]
    again = [ch.text for ch in c.completions.create(**args).choices]
    assert len(first) == 3 and first == again and len(set(first)) > 1
    greedy = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2, temperature=0
    )
    assert [ch.index for ch in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_penalties_bias_min_p_and_stops_each_change_the_output_as_specified(server):
    prompt = "Colors: red, blue, red, blue, red,"  # greedy: " blue, blue, blue, ..."

    def run(route="/v1/completions", **extra):
        with server.client() as h:
            r = h.post(route, json={"prompt": prompt, "max_tokens": 12, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json() if route == "/infer" else r.json()["choices"][0]

    base = run()
    assert base["text"]
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 3.0}):
        assert run(**penalty)["text"] != base["text"], penalty
    first_id = run("/infer", max_tokens=1, logprobs=0)["logprobs"][0]["token_id"]
    banned = run("/infer", max_tokens=1, logprobs=0, logit_bias={str(first_id): -100})
    assert banned["logprobs"][0]["token_id"] != first_id
    forced = run("/infer", max_tokens=3, logprobs=0, logit_bias={"1000": 100})
    assert [e["token_id"] for e in forced["logprobs"]] == [1000, 1000, 1000]
    assert run(min_p=1.0, temperature=1.0, seed=5)["text"] == base["text"]  # min-p 1 keeps only the top token
    stopped = run(stop_token_ids=[first_id])
    assert stopped["finish_reason"] == "stop" and stopped["text"] == ""
    with server.client() as h:
        r = h.post("/v1/completions", json={"prompt": prompt, "max_completion_tokens": 3, "max_tokens": 9}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 3


def test_ignore_eos_generates_past_the_end(server):
    with server.client() as h:
        chat = {"messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 48, "temperature": 0}
        normal = h.post("/v1/chat/completions", json=chat).json()["choices"][0]
        forced = h.post("/v1/chat/completions", json={**chat, "ignore_eos": True}).json()
    assert normal["finish_reason"] == "stop"
    assert forced["choices"][0]["finish_reason"] == "length" and forced["usage"]["completion_tokens"] == 48


def test_message_and_prompt_forms(server):
    with server.client() as h:
        parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}]
        as_parts = h.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 6, "temperature": 0}).json()
        as_text = h.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "temperature": 0},
        ).json()
        assert as_parts["choices"][0]["message"] == as_text["choices"][0]["message"]
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
        r = h.post("/v1/chat/completions", json={"messages": image})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0.type"
        text = h.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0}).json()
        ids = h.post("/infer", json={"prompt": "Hello there", "max_tokens": 1, "logprobs": 0}).json()
        two = h.post(
            "/v1/completions", json={"prompt": ["Hello there", "The sky is"], "max_tokens": 4, "temperature": 0}
        ).json()
        assert [c["index"] for c in two["choices"]] == [0, 1] and two["choices"][0]["text"] == text["choices"][0][
            "text"
        ]
        assert ids["usage"]["prompt_tokens"] > 0
        r = h.post("/v1/completions", json={"prompt": "x", "suffix": "y"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


@pytest.mark.parametrize(
    ("route", "field", "value"),
    [
        ("/v1/completions", "best_of", 2),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/chat/completions", "audio", {"voice": "alloy"}),
        ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
        ("/v1/chat/completions", "web_search_options", {}),
    ],
)
def test_each_unsupported_field_is_a_400_naming_it(server, route, field, value):
    body = {"prompt": "Hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    with server.client() as h:
        r = h.post(route, json={**body, field: value, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
        ok = h.post(route, json={**body, "user": "u1", "metadata": {"k": "v"}, "store": False, "max_tokens": 2})
        assert ok.status_code == 200
