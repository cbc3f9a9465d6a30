"""`stepserve bench`'s load levels against a scripted HTTP server (httpx's mock transport): what
a level counts, independent of any model."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

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


def test_long_arrival_splits_itl_before_and_while_the_long_request_decodes():
    """The mixed-load figure: gaps wholly before the long request's send count as "before",
    gaps between its first token and its end as "while it decodes"; the window's own gap is
    neither."""
    from service.bench.common import Stream
    from service.bench.long_arrival import window_figures

    # 10 ms gaps before the send at t=1.0, a 500 ms stall in the window [1.0, 1.5], 20 ms after
    arrivals = [0.95, 0.96, 0.97, 0.98, 0.99, 1.49, 1.51, 1.53, 1.55, 1.57, 1.59]
    streams = [Stream(start=0.0, arrivals=list(arrivals)), Stream(start=0.0, arrivals=[a + 0.001 for a in arrivals])]
    figures = window_figures(streams, start=1.0, end=1.5, long_end=1.6)
    assert figures["itl_before_window_s_p50"] == pytest.approx(0.01)
    assert figures["itl_while_long_decodes_s_p50"] == pytest.approx(0.02)
    assert figures["itl_while_long_decodes_over_before"] == pytest.approx(2.0)
    assert figures["max_gap_in_window_s"] == pytest.approx(0.5)
    assert figures["itl_while_long_decodes_gaps"] == 8  # 4 per stream after the first token at 1.5; not the stall
    assert window_figures(streams, 1.0, 1.5)["itl_while_long_decodes_s_p50"] is None


def test_documents_are_long_and_share_no_prefix_within_a_run_or_across_runs():
    """The documents workload measures KV memory only if no request's prompt is a prefix-cache
    hit for another's: each document differs from its first words, also in a second run."""
    from service.bench.load import Workload

    def documents(n: int) -> list[str]:
        workload = Workload("documents", max_tokens=8, system_tokens=300)
        return [workload.request(0)[1]["messages"][0]["content"] for _ in range(n)]

    first, second = documents(4), documents(2)
    assert all(len(d.split()) >= 300 for d in first)
    starts = [d.split()[:2] for d in first + second]
    assert len({tuple(s) for s in starts}) == len(starts)
    bodies = [d.split()[2:] for d in first + second]  # the random words differ too, not only the label
    assert len({tuple(b) for b in bodies}) == len(bodies)
