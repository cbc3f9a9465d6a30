"""The HTTP half of warm-up: before ``/readyz`` turns 200, the app sends each route a few
requests through its own ASGI stack, so what the first clients would otherwise build — FastAPI's
per-route request handling, request validation, the chat template's Jinja compile, the
tokenizer's vocabulary scan for the prompt-size bound, the SSE writers, a grammar's first
compile — is built now, not under the first burst (:mod:`service.process.warmer` rehearses the
engine's own step the same way).

Rehearsal requests carry :data:`REHEARSAL` (a context variable set for the in-process client's
task): routes accept them before the model is ready, and they are left out of every metric.
"""

from __future__ import annotations

import asyncio
import logging
from contextvars import ContextVar
from typing import Any

import httpx

from service.api.tools import render_messages

log = logging.getLogger("stepserve.api")

REHEARSAL: ContextVar[bool] = ContextVar("stepserve_rehearsal", default=False)

_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}


def plan(model: str, chat: bool) -> list[tuple[str, str, dict[str, Any]]]:
    """The rehearsal requests for ``model``: ``(what, path, JSON body)``, each at most two
    tokens out. ``chat``: the model has a chat template (the chat routes are rehearsed too)."""
    short = {"model": model, "max_tokens": 2}
    prompt = {**short, "prompt": "Hello"}
    messages = {**short, "messages": [{"role": "user", "content": "Hello"}]}
    steps = [
        ("/infer", "/infer", prompt),
        ("/infer streamed", "/infer", {**prompt, "stream": True}),
        ("/v1/completions", "/v1/completions", prompt),
        ("/v1/completions streamed, logprobs", "/v1/completions", {**prompt, "stream": True, "logprobs": 2}),
    ]
    if chat:
        steps += [
            ("/v1/chat/completions", "/v1/chat/completions", messages),
            ("/v1/chat/completions streamed", "/v1/chat/completions", {**messages, "stream": True}),
            (
                "/v1/chat/completions, a JSON object",
                "/v1/chat/completions",
                {**messages, "response_format": {"type": "json_object"}},
            ),
            (
                "/v1/chat/completions, a required tool call, streamed",
                "/v1/chat/completions",
                {**messages, "tools": [_TOOL], "tool_choice": "required", "stream": True},
            ),
            ("/v1/messages streamed", "/v1/messages", {**messages, "stream": True}),
            (
                "/v1/responses streamed",
                "/v1/responses",
                {"model": model, "input": "Hello", "max_output_tokens": 2, "stream": True, "store": False},
            ),
        ]
    return steps


def burst(model: str, streams: int, longest_words: int) -> list[dict[str, Any]]:
    """The bodies of a burst of ``streams`` concurrent, greedy, streamed completions, as a
    client's first burst sends them: prompts of 2 to ``longest_words`` words (spread over the
    prompt buckets) and 2 to 6 tokens out, so rows finish at different steps."""
    words = "the quick brown fox jumps over a lazy dog while seven bakers sing".split()
    bodies = []
    for i in range(streams):
        n = 2 + (i * 37) % max(1, longest_words - 1)
        prompt = " ".join(words[(i + j) % len(words)] for j in range(n))
        bodies.append({"model": model, "prompt": prompt, "max_tokens": 2 + i % 5, "temperature": 0, "stream": True})
    return bodies


def prompt_tokens(tokenizer, body: dict[str, Any]) -> int:
    """Tokens of a rehearsal request's prompt (chat messages, or a Responses ``input`` text as
    one user turn, through the chat template)."""
    if "input" in body:
        body = {"messages": [{"role": "user", "content": body["input"]}]}
    if "messages" in body:  # as the chat route renders them (a template without tools: the fallback prompt)
        return len(tokenizer.encode(render_messages(tokenizer, body["messages"], body.get("tools"))))
    return len(tokenizer.encode(body["prompt"]))


async def run(app, model: str, tokenizer, api_key: str | None, streams: int = 1, limit: int = 64) -> list[str]:
    """Send :func:`plan`'s requests for ``model`` (its ``tokenizer`` counts their prompt tokens;
    with a chat template the chat routes are rehearsed too) to ``app`` in process
    (``httpx.ASGITransport``: the whole middleware stack and the routes, not the socket), one
    after another, then :func:`burst`'s ``streams`` requests at once; returns one line per
    request (one for the burst).

    Only prompts of at most ``limit`` tokens are sent (the warm-up's extent: a longer one would
    build buckets the warm-up left cold on purpose); a request that does not fit is reported as
    skipped. A request that does not answer 200 is logged as a warning and reported; it does not
    stop the server from becoming ready (the same request from a client gets the same answer).
    """
    chat = bool(getattr(tokenizer, "chat_template", None))
    token = REHEARSAL.set(True)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    done = []
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rehearsal", headers=headers) as client:
            for what, path, body in plan(model, chat):
                if (n := prompt_tokens(tokenizer, body)) > limit:
                    done.append(f"HTTP {what}: skipped ({n} prompt tokens, past the warm-up's {limit})")
                    continue
                response = await client.post(path, json=body, timeout=None)
                if response.status_code != 200:
                    log.warning("HTTP rehearsal: %s answered %d: %s", what, response.status_code, response.text[:300])
                    what += f" (answered {response.status_code})"
                done.append(f"HTTP {what}")
            if streams > 1:
                bodies = [b for b in burst(model, streams, max(2, limit // 2)) if prompt_tokens(tokenizer, b) <= limit]
                answers = await asyncio.gather(
                    *(client.post("/v1/completions", json=body, timeout=None) for body in bodies)
                )
                failed = [a.status_code for a in answers if a.status_code != 200]
                if failed:
                    log.warning("HTTP rehearsal: the burst had answers %s", failed)
                done.append(
                    f"HTTP a burst of {streams} streamed completions at once"
                    + (f" ({len(failed)} not 200)" if failed else "")
                )
    finally:
        REHEARSAL.reset(token)
    return done
