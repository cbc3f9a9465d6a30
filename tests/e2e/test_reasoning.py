"""Reasoning apart from the answer, through a real `stepserve serve` of a tiny random model
whose chat template opens ``<think>`` (as DeepSeek-R1's does, or Qwen3's with a forced
prefix): whatever the model writes until ``</think>`` is reasoning. The answer of each route is
checked against the raw text of the same prompt from ``/v1/completions`` (greedy), split at its
first ``</think>`` here with ``str.partition``, through the official ``openai`` and
``anthropic`` clients."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from tokenizers import AddedToken, Tokenizer

from tests.support import ServerProcess, write_served_dir

ARGS = [
    *("--model-name", "thinker", "--batch-buckets", "1,2", "--prompt-buckets", "16,32"),
    *("--capacity-buckets", "64,128", "--warmup-prompt-tokens", "32", "--warmup-batch", "2"),
]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}<think>"
ASK = [{"role": "user", "content": "t5 t6 t7"}]
N = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = write_served_dir(tmp_path_factory.mktemp("think") / "thinker")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    # <think> and </think> take the ids of t94 and t95 (the model's vocabulary is 96 rows)
    vocab_json = json.loads(tokenizer.to_str())
    model_vocab = vocab_json["model"]["vocab"]
    del model_vocab["t94"], model_vocab["t95"]
    model_vocab["<think>"], model_vocab["</think>"] = vocab["t94"], vocab["t95"]
    tokenizer = Tokenizer.from_str(json.dumps(vocab_json))
    tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    assert tokenizer.token_to_id("</think>") == 95
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    proc = ServerProcess.start(["--model", str(directory), *ARGS])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def raw_split(server) -> tuple[str, str]:
    """The greedy raw text of the rendered prompt, split at its first </think> (reasoning, answer)."""
    with server.client() as http:
        reply = http.post("/v1/completions", json={"prompt": "t5 t6 t7 <think>", "max_tokens": N, "temperature": 0})
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["text"]
    thought, _, answer = text.partition("</think>")
    return thought.strip(), answer.strip()


def raw_reasoning_tokens(server) -> int:
    """The output tokens of the greedy raw text through its first </think> (all of them when it
    never closes): what the routes report as reasoning tokens."""
    body = {"prompt": "t5 t6 t7 <think>", "max_tokens": N, "temperature": 0, "logprobs": 0}
    with server.client() as http:
        reply = http.post("/v1/completions", json=body).json()
    tokens = reply["choices"][0]["logprobs"]["tokens"]
    total = reply["usage"]["completion_tokens"]
    return tokens.index("</think>") + 1 if "</think>" in tokens else total


def test_reasoning_tokens_are_counted_through_the_closing_tag_on_chat_and_responses(server):
    expected = raw_reasoning_tokens(server)
    assert expected > 0
    with server.client() as http:
        chat = {"model": "thinker", "messages": ASK, "max_tokens": N, "temperature": 0}
        whole = http.post("/v1/chat/completions", json=chat).json()
        stream = {**chat, "stream": True, "stream_options": {"include_usage": True}}
        lines = http.post("/v1/chat/completions", json=stream).text.split("\n\n")
        usage = next(json.loads(x[6:])["usage"] for x in lines if x.startswith("data: {") and '"usage": {' in x)
        answers = [
            http.post("/v1/responses", json={"model": "thinker", "input": "t5 t6 t7", "max_output_tokens": N, **extra})
            for extra in ({"temperature": 0}, {"temperature": 0, "stream": True})
        ]
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == expected
    assert usage["completion_tokens_details"]["reasoning_tokens"] == expected
    response = answers[0].json()
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == expected
    last = [x for x in answers[1].text.split("\n\n") if x][-1].split("data: ", 1)[1]
    assert json.loads(last)["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == expected


def test_chat_completions_give_reasoning_content_streamed_and_not(server):
    thought, answer = raw_split(server)
    assert thought, "the random model's greedy text starts with reasoning"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    whole = client.chat.completions.create(model="thinker", messages=ASK, max_tokens=N, temperature=0)
    message = whole.choices[0].message
    assert message.reasoning_content.strip() == thought  # type: ignore[attr-defined]
    assert (message.content or "").strip() == answer
    chunks = list(
        client.chat.completions.create(model="thinker", messages=ASK, max_tokens=N, temperature=0, stream=True)
    )
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed.strip() == thought and content.strip() == answer


def test_responses_give_a_reasoning_item_streamed_and_not(server):
    thought, answer = raw_split(server)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    args = dict(model="thinker", input="t5 t6 t7", max_output_tokens=N, temperature=0)
    args["reasoning"] = {"effort": "medium", "summary": "auto"}  # what Codex CLI sends
    whole = client.responses.create(**args)  # type: ignore[arg-type]
    kinds = [item.type for item in whole.output]
    assert kinds[0] == "reasoning" and whole.output[0].content[0].text.strip() == thought  # type: ignore[union-attr]
    assert whole.output_text.strip() == answer
    events = list(client.responses.create(**args, stream=True))  # type: ignore[arg-type]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas.strip() == thought
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert len(done) == 1 and done[0].text == deltas


def test_messages_give_a_thinking_block_streamed_and_not(server):
    thought, answer = raw_split(server)
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    args = dict(model="thinker", max_tokens=N, messages=ASK, extra_body={"temperature": 0})
    whole = client.messages.create(**args)  # type: ignore[arg-type]
    assert whole.content[0].type == "thinking" and whole.content[0].thinking.strip() == thought
    assert "".join(b.text for b in whole.content if b.type == "text").strip() == answer
    with client.messages.stream(**args) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert "".join(deltas).strip() == thought and final.content[0].type == "thinking"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "high"}, "reasoning_effort"),
        ("/v1/responses", {"input": "t5", "reasoning": {"effort": "low"}}, "reasoning.effort"),
        ("/v1/responses", {"input": "t5", "reasoning": {"summary": "detailed"}}, "reasoning.summary"),
        (
            "/v1/messages",
            {"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 2}},
            "thinking.budget_tokens",
        ),
        ("/v1/messages", {"max_tokens": 4, "messages": ASK, "thinking": {"type": "disabled"}}, "thinking"),
    ],
)
def test_reasoning_controls_the_model_cannot_honour_answer_400_naming_the_field(server, path, body, param):
    """The template always opens <think> and takes no variable: only effort 'medium' is served."""
    with server.client() as http:
        reply = http.post(path, json={"model": "thinker", **body})
        again = http.post("/v1/chat/completions", json={"model": "thinker", "messages": ASK, "max_tokens": 2})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param if "param" in error else param in error["message"]
    assert again.status_code == 200
