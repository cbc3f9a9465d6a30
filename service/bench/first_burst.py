"""``stepserve bench --workload first-burst``: does a server that just became ready answer
its first burst of requests as fast as its second?

Waits until ``GET --ready-path`` (default ``/readyz``) answers 200, then at once sends a
burst of N concurrent, greedy, streamed requests to ``/v1/completions`` (request i takes
prompt i of the load tool's essay set, of mixed lengths; ``--max-tokens`` each). Once all have
finished it sends the identical burst again. Each N of ``--concurrency`` runs in turn, so
only the first meets a server that had served nothing (``requests_served_before`` says what
each met): for a clean figure at several N, start a fresh server for each.

Reported per burst: TTFT p50/p99, errors, prompt tokens and prefix-cache hits (the second
burst repeats the first's prompts, so a prefix cache may serve them: serve with
``--prefix-cache-bytes 0`` to take that out) and the compile misses a stepserve counted;
then first / second for TTFT p50 and p99. The issue's target: the first burst's p99 at most
1.5 times the second's (``target_met``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import httpx
from rich.table import Table

from service.bench.common import (
    MISSES,
    Stream,
    essay_prompts,
    fmt,
    level_figures,
    report,
    stepserve_counters,
    stream_request,
)

TARGET = 1.5  # first-burst TTFT p99 / second-burst TTFT p99, at most (the goal)
REQUESTS = "stepserve_requests_total"


def wait_ready(url: str, path: str, timeout_s: float) -> float:
    """Poll ``GET url+path`` every 50 ms until it answers 200; returns the seconds waited.
    Raises SystemExit when it has not within ``timeout_s``."""
    start = time.perf_counter()
    with httpx.Client(base_url=url, timeout=5) as client:
        while time.perf_counter() - start < timeout_s:
            try:
                if client.get(path).status_code == 200:
                    return time.perf_counter() - start
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise SystemExit(f"{url}{path} did not answer 200 within {timeout_s} s")


async def burst(url: str, n: int, max_tokens: int, model: str | None) -> dict:
    """``n`` concurrent streamed requests, request i with essay prompt i (cycling). Returns
    :func:`~service.bench.common.level_figures` of the burst."""
    prompts = essay_prompts()
    bodies = [
        {
            "model": model,
            "prompt": prompts[i % len(prompts)],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(n)
    ]
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=n + 4)) as client:
        start = time.perf_counter()
        done = await asyncio.gather(
            *(stream_request(client, "/v1/completions", body) for body in bodies), return_exceptions=True
        )
        elapsed = time.perf_counter() - start
    records = [r for r in done if isinstance(r, Stream) and not r.error]
    return level_figures(records, n - len(records), elapsed)


def _ratio(first: float | None, second: float | None) -> float | None:
    return first / second if first is not None and second else None


def run_level(url: str, n: int, args: argparse.Namespace) -> dict:
    """The first and the second burst of ``n`` requests, with the compile misses and finished
    requests a stepserve counted (None on another server), and first / second TTFT."""
    with httpx.Client(base_url=url, timeout=60) as client:
        read = stepserve_counters(client, [REQUESTS, MISSES])

        def counters() -> dict[str, float]:
            return read() if read else {}

        before = counters()
        first = asyncio.run(burst(url, n, args.max_tokens, args.model))
        between = counters()
        second = asyncio.run(burst(url, n, args.max_tokens, args.model))
        after = counters()
    if read:
        first["compile_misses"] = between[MISSES] - before[MISSES]
        second["compile_misses"] = after[MISSES] - between[MISSES]
    p99 = _ratio(first["ttft_s_p99"], second["ttft_s_p99"])
    return {
        "concurrency": n,
        "requests_served_before": before.get(REQUESTS),
        "first": first,
        "second": second,
        "ttft_p50_first_over_second": _ratio(first["ttft_s_p50"], second["ttft_s_p50"]),
        "ttft_p99_first_over_second": p99,
        "target_met": p99 <= TARGET if p99 is not None else None,
    }


def _table(result: dict) -> Table:
    table = Table(title=f"first-burst: {result['url']} (max_tokens {result['max_tokens']}; ratios first / second)")
    columns = ("burst", "served before", "errors", "TTFT p50/p99 s 1st", "TTFT p50/p99 s 2nd", "p50 ratio")
    for col in (*columns, "p99 ratio", f"p99 ≤ {TARGET}x", "cached tok 1st/2nd", "compile misses 1st/2nd"):
        table.add_column(col, justify="right")
    for r in result["levels"]:
        a, b = r["first"], r["second"]
        table.add_row(
            str(r["concurrency"]),
            fmt(r["requests_served_before"], digits=0),
            f"{a['errors']}/{b['errors']}",
            f"{fmt(a['ttft_s_p50'])}/{fmt(a['ttft_s_p99'])}",
            f"{fmt(b['ttft_s_p50'])}/{fmt(b['ttft_s_p99'])}",
            fmt(r["ttft_p50_first_over_second"], digits=2),
            fmt(r["ttft_p99_first_over_second"], digits=2),
            {True: "yes", False: "no", None: "-"}[r["target_met"]],
            f"{fmt(a['cached_tokens_total'], digits=0)}/{fmt(b['cached_tokens_total'], digits=0)}",
            f"{fmt(a.get('compile_misses'), digits=0)}/{fmt(b.get('compile_misses'), digits=0)}",
        )
    return table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepserve bench --workload first-burst",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workload", choices=["first-burst"], required=True, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8], help="requests per burst, one level each")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ready-path", default="/readyz", help="polled until it answers 200")
    parser.add_argument("--ready-timeout-s", type=float, default=900.0)
    parser.add_argument("--model", help="model name to send (required by some OpenAI servers)")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    return parser


def main(argv: list[str]) -> int:
    """``stepserve bench --workload first-burst [options]``: wait for ready, run the bursts,
    print the table to stderr and the JSON to stdout (and ``--out``). Returns 0."""
    args = _parser().parse_args(argv)
    waited = wait_ready(args.url, args.ready_path, args.ready_timeout_s)
    levels = [run_level(args.url, n, args) for n in args.concurrency]
    result = {
        "url": args.url,
        "ready_wait_s": waited,
        "max_tokens": args.max_tokens,
        "target": TARGET,
        "levels": levels,
    }
    return report(result, argv, [_table(result)], args.out)
