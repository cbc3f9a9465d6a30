"""``stepserve bench --workload long-arrival``: do running streams stall while a long prompt
is prefilled?

``--streams`` client streams (default 4) each send one greedy, streamed request for a long
output (``--max-tokens``; essay prompts of the load tool). Once every stream has received
``--lead-tokens`` tokens, one request with a long prompt (about ``--long-prompt-tokens``
tokens of words drawn here, new each run so no prefix cache holds it) arrives. The window is
from its send to its first token. Each stream is closed once it has seen ``--tail-tokens``
tokens after the window (the server sees a client that left); one that ends sooner is fine.

Reported: the largest inter-token gap of the streams that overlaps the window (the stall a
user would see), each stream's largest one, the streams' inter-token latency p50/p99
outside the window, the tokens each stream got during it, and the long prompt's own TTFT and
prompt tokens (the server's ``usage``), and the compile misses a stepserve counted meanwhile.
All requests go to ``/v1/completions``. Run it once
against a server with chunked prefill and once against one without
(``stepserve serve --prefill-chunk-tokens 8192 --prompt-buckets '[32,64,128,256,512,1024,2048,4096,8192]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path

import httpx
from rich.table import Table

from service.bench.common import (
    MISSES,
    Stream,
    essay_prompts,
    fmt,
    percentile,
    report,
    stepserve_counters,
    stream_request,
    word_prompt,
)


def _body(prompt: str, max_tokens: int, model: str | None) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def measure(url: str, args: argparse.Namespace) -> tuple[list[Stream], Stream]:
    """Run the streams and the long request (see the module's doc). Returns (the streams'
    records, the long request's record). Raises SystemExit when a stream ends or fails before
    every stream has its lead tokens, or when the long request fails; httpx.HTTPError when
    the server does not answer."""
    prompts = essay_prompts()
    streams = [Stream() for _ in range(args.streams)]
    long = Stream()

    def seen_tail(rec: Stream) -> bool:  # or the long request failed: nothing left to measure
        if long.error or (long.end and not long.arrivals):
            return True
        return bool(long.arrivals) and sum(t > long.arrivals[0] for t in rec.arrivals) >= args.tail_tokens

    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        tasks = [
            asyncio.create_task(
                stream_request(
                    client,
                    "/v1/completions",
                    _body(prompts[i % len(prompts)], args.max_tokens, args.model),
                    rec,
                    until=lambda rec=rec: seen_tail(rec),
                )
            )
            for i, rec in enumerate(streams)
        ]
        while any(len(rec.arrivals) < args.lead_tokens for rec in streams):
            if any(task.done() for task in tasks):
                await asyncio.gather(*tasks)  # re-raises a transport error
                raise SystemExit(f"a stream ended before the long prompt was sent: {[r.error for r in streams]}")
            await asyncio.sleep(0.005)
        prompt = word_prompt(random.Random(), args.long_prompt_tokens)  # unseeded: new words each run
        await stream_request(client, "/v1/completions", _body(prompt, args.long_max_tokens, args.model), long)
        await asyncio.gather(*tasks)
    if long.error or not long.arrivals:
        raise SystemExit(f"the long request failed: {long.error}")
    return streams, long


def window_figures(streams: list[Stream], start: float, end: float, long_end: float | None = None) -> dict:
    """Gaps between the streams' tokens against the window [``start``, ``end``] (perf_counter
    seconds): a gap overlaps it when it ends after ``start`` and begins before ``end``; one
    entirely before or after lies outside. With ``long_end`` (when the long request's stream
    ended), also the streams' inter-token latency p50 before the window and while the long
    request decodes ([``end``, ``long_end``]), and their ratio (issue #28's mixed-load figure:
    the running chats' ITL while a long document decodes beside them, against before it came).
    Seconds throughout."""
    inside = [[b - a for a, b in rec.gaps if b > start and a < end] for rec in streams]
    outside = [b - a for rec in streams for a, b in rec.gaps if b <= start or a >= end]
    before = [b - a for rec in streams for a, b in rec.gaps if b <= start]
    during = [b - a for rec in streams for a, b in rec.gaps if long_end is not None and a >= end and b <= long_end]
    p50_before, p50_during = percentile(before, 0.5), percentile(during, 0.5)
    return {
        "itl_before_window_s_p50": p50_before,
        "itl_while_long_decodes_s_p50": p50_during,
        "itl_while_long_decodes_gaps": len(during),
        "itl_while_long_decodes_over_before": p50_during / p50_before if p50_before and p50_during else None,
        "max_gap_in_window_s": max((max(g) for g in inside if g), default=None),
        "max_gap_in_window_s_per_stream": [max(g, default=None) for g in inside],
        "itl_outside_window_s_p50": percentile(outside, 0.5),
        "itl_outside_window_s_p99": percentile(outside, 0.99),
        "tokens_in_window_per_stream": [sum(start < t <= end for t in rec.arrivals) for rec in streams],
        "streams_past_window": sum(bool(rec.arrivals) and rec.arrivals[-1] >= end for rec in streams),
        "stream_errors": [rec.error for rec in streams if rec.error],
    }


def _table(result: dict) -> Table:
    table = Table(title=f"long-arrival: {result['url']} ({result['streams']} streams)")
    columns = (
        "long prompt tok",
        "long TTFT s",
        "max gap in window ms",
        "ITL p50/p99 outside ms",
        "ITL p50 before / while long decodes ms",
    )
    for col in (*columns, "tokens in window", "streams past window", "compile misses"):
        table.add_column(col, justify="right")
    table.add_row(
        str(result["long_prompt_tokens"]),
        fmt(result["long_ttft_s"]),
        fmt(result["max_gap_in_window_s"], 1e3, 1),
        f"{fmt(result['itl_outside_window_s_p50'], 1e3, 1)}/{fmt(result['itl_outside_window_s_p99'], 1e3, 1)}",
        f"{fmt(result['itl_before_window_s_p50'], 1e3, 1)} / {fmt(result['itl_while_long_decodes_s_p50'], 1e3, 1)}",
        " ".join(map(str, result["tokens_in_window_per_stream"])),
        f"{result['streams_past_window']}/{result['streams']}",
        fmt(result["compile_misses"], digits=0),
    )
    return table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepserve bench --workload long-arrival",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workload", choices=["long-arrival"], required=True, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--streams", type=int, default=4, help="running streams (K)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="each stream's max_tokens (it is cut earlier)")
    parser.add_argument("--lead-tokens", type=int, default=8, help="tokens every stream has before the long prompt")
    parser.add_argument("--tail-tokens", type=int, default=16, help="tokens a stream reads after the window")
    parser.add_argument(
        "--long-prompt-tokens", type=int, default=6000, help="the long prompt's size in words (~tokens)"
    )
    parser.add_argument("--long-max-tokens", type=int, default=8, help="the long request's max_tokens")
    parser.add_argument("--model", help="model name to send (required by some OpenAI servers)")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    return parser


def main(argv: list[str]) -> int:
    """``stepserve bench --workload long-arrival [options]``: measure, print the table to stderr
    and the JSON to stdout (and ``--out``). Returns 0."""
    args = _parser().parse_args(argv)
    with httpx.Client(base_url=args.url, timeout=60) as client:
        read = stepserve_counters(client, [MISSES])
        before = read()[MISSES] if read else 0.0
        streams, long = asyncio.run(measure(args.url, args))
        misses = read()[MISSES] - before if read else None
    start, end = long.start, long.arrivals[0]
    result = {
        "url": args.url,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "lead_tokens": args.lead_tokens,
        "tail_tokens": args.tail_tokens,
        "long_prompt_words": args.long_prompt_tokens,
        "long_prompt_tokens": long.prompt_tokens,
        "long_cached_tokens": long.cached_tokens,
        "long_ttft_s": long.ttft_s,
        "compile_misses": misses,  # a stepserve's, during the run: a miss is a stall of its own
        "long_completion_tokens": long.tokens,
        **window_figures(streams, start, end, long.end),
    }
    return report(result, argv, [_table(result)], args.out)
