"""`stepserve bench`'s load levels against a scripted HTTP server (httpx's mock transport): what
a level counts, independent of any model."""

from __future__ import annotations

import asyncio
import json

import httpx

from service.bench.load import Workload, run_level


def scripted_server(free_tokens: int) -> httpx.MockTransport:
    """/v1/completions that streams ``free_tokens`` tokens and its usage to a free request, and
    tokens every 5 ms without end to a constrained one (``response_format``)."""

    async def events(constrained: bool):
        sent = 0
        while constrained or sent < free_tokens:
            await asyncio.sleep(0.005)
            sent += 1
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n".encode()
        usage = {"prompt_tokens": 3, "completion_tokens": sent, "total_tokens": sent + 3}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()

    async def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        return httpx.Response(
            200, content=events("response_format" in body), headers={"content-type": "text/event-stream"}
        )

    return httpx.MockTransport(handle)


def test_a_constrained_stream_still_streaming_when_the_free_ones_finish_is_closed_and_counted():
    """A level keeps its constrained rows only while free streams run: the request a constrained
    stream has in flight then ends at its next token, its tokens so far counted, so the level
    has no tail of constrained rows alone (here it would never end)."""
    workload = Workload("essays", "openai", 8, None, streams=3, constrained=1, schema="report")
    level = asyncio.run(asyncio.wait_for(run_level("http://bench", 3, 2, workload, scripted_server(8)), timeout=30))
    assert level["errors"] == 0 and level["constrained_requests"] == 1 and level["constrained_closed_early"] == 1
    assert level["requests"] == 2 * 2 + 1  # the free streams' two each, and the constrained one
    free_tokens = 2 * 2 * 8
    constrained_tokens = level["completion_tokens"] - free_tokens
    # It streamed all along: about as many tokens as one free stream's two requests (5 ms each).
    assert 8 <= constrained_tokens <= 4 * 2 * 8, level
