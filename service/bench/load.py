"""``stepserve bench``: measure a running server from the outside, over HTTP.

For each concurrency level, that many client streams send greedy, streamed requests one
after another (``POST /infer`` or OpenAI's ``POST /v1/completions``; a generated prompt set
of mixed lengths). Reported per level: aggregate tokens/s (all completion tokens over the
level's wall time), per-stream tokens/s (the median over requests of completion tokens over
the request's wall time, TTFT included), TTFT and inter-token latency p50/p99 as the client
sees them (first text chunk; gaps between chunks), errors, and the compile-cache misses a
stepserve counted during the level. A table goes to stderr, JSON to stdout and optionally a
file. Measurements: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
from rich.table import Table

from service.bench.common import (
    essay_prompts,
    machine_info,
    metric_labels,
    percentile,
    plot_levels,
    print_table,
    scrape,
)

MISSES = "stepserve_compile_cache_misses_total"


def _request(api: str, prompt: str, max_tokens: int, model: str | None) -> tuple[str, dict]:
    """Path and streaming JSON body of one greedy request in the chosen API."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if api == "openai":
        return "/v1/completions", {**body, "model": model, "stream_options": {"include_usage": True}}
    return "/infer", {**body, **({"model": model} if model else {})}


async def _one(client: httpx.AsyncClient, api: str, prompt: str, max_tokens: int, model: str | None) -> dict | None:
    """Send one streaming request; TTFT and ITL are measured here, at the client."""
    path, body = _request(api, prompt, max_tokens, model)
    start = time.perf_counter()
    arrivals, usage = [], None
    async with client.stream("POST", path, json=body) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return None
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            choices = event.get("choices") or [{}]
            if event.get("text") or choices[0].get("text"):
                arrivals.append(time.perf_counter())
    wall = time.perf_counter() - start
    tokens = usage["completion_tokens"] if usage else len(arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"tokens": tokens, "wall_s": wall, "ttft_s": arrivals[0] - start if arrivals else None, "itl_s": gaps}


async def run_level(
    url: str,
    concurrency: int,
    requests_per_stream: int,
    max_tokens: int,
    prompts: list[str],
    api: str = "infer",
    model: str | None = None,
) -> dict:
    """Run one concurrency level: ``concurrency`` client streams, each sending
    ``requests_per_stream`` requests back to back, prompts taken in turn from ``prompts``.

    Returns the level's figures: seconds, tokens per second, percentiles
    (:func:`~service.bench.common.percentile`); a request that failed (a non-200 answer or
    an httpx.HTTPError) counts in ``errors`` and nowhere else.
    """
    records, errors = [], 0

    async def stream(client: httpx.AsyncClient, index: int) -> None:
        nonlocal errors
        for j in range(requests_per_stream):
            try:
                record = await _one(client, api, prompts[(index + j * concurrency) % len(prompts)], max_tokens, model)
            except httpx.HTTPError:
                record = None
            if record is None:
                errors += 1
            else:
                records.append(record)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(stream(client, i) for i in range(concurrency)))
        elapsed = time.perf_counter() - start
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    itl = [gap for r in records for gap in r["itl_s"]]
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "errors": errors,
        "completion_tokens": sum(r["tokens"] for r in records),
        "elapsed_s": elapsed,
        "aggregate_tok_s": sum(r["tokens"] for r in records) / elapsed,
        "per_stream_tok_s_p50": statistics.median(r["tokens"] / r["wall_s"] for r in records) if records else None,
        "ttft_s_p50": percentile(ttft, 0.5),
        "ttft_s_p99": percentile(ttft, 0.99),
        "itl_s_p50": percentile(itl, 0.5),
        "itl_s_p99": percentile(itl, 0.99),
    }


def run(
    url: str,
    levels: list[int],
    requests_per_stream: int,
    max_tokens: int,
    api: str = "infer",
    model: str | None = None,
    warmup_requests: int = 0,
) -> dict:
    """Every concurrency level in turn (:func:`run_level`), with the compile misses the server
    counted in each (None for a server without stepserve's /metrics, such as mlx_lm.server).

    ``warmup_requests`` > 0 first runs each level untimed with that many requests per
    stream, so that a server which builds its kernels on first use (on CUDA, NVRTC takes
    seconds per new kernel) is measured warm; misses during that pass are reported as
    ``warmup_compile_misses`` (stepserve should have none: it warms up before it is ready).
    Raises httpx.HTTPError when the server does not answer.
    """
    prompts = essay_prompts()
    with httpx.Client(base_url=url, timeout=60) as client:
        stepserve = client.get("/metrics").status_code == 200
        build = metric_labels(client, "stepserve_build_info") if stepserve else {}

        def misses() -> float:
            return scrape(client, [MISSES])[MISSES] if stepserve else 0.0

        results = []
        for level in levels:
            before = misses()
            if warmup_requests:
                asyncio.run(run_level(url, level, warmup_requests, max_tokens, prompts, api, model))
            timed = misses()
            result = asyncio.run(run_level(url, level, requests_per_stream, max_tokens, prompts, api, model))
            result["compile_misses"] = misses() - timed if stepserve else None
            result["warmup_compile_misses"] = timed - before if stepserve and warmup_requests else None
            results.append(result)
    return {
        "url": url,
        "api": api,
        "build": build,
        "max_tokens": max_tokens,
        "requests_per_stream": requests_per_stream,
        "warmup_requests_per_stream": warmup_requests,
        "levels": results,
    }


OTHER_FORMS = """other forms (each has --help):
  stepserve bench --side-by-side ...  stepserve and mlx_lm.server on the same weights
  stepserve bench --micro ...         plain vs compiled, in-process
  stepserve bench steps ...           one prefill and decode step per dtype, weight format, compile mode
  stepserve bench profile ...         where a decode step's time goes"""


def fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    """``value * scale`` with ``digits`` decimals, or "-" for None."""
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _table(result: dict) -> Table:
    table = Table(title=f"stepserve bench: {result['url']} (max_tokens {result['max_tokens']})")
    for col in (
        "streams",
        "requests",
        "errors",
        "aggregate tok/s",
        "per-stream tok/s",
        "TTFT p50/p99 s",
        "ITL p50/p99 ms",
        "compile misses",
    ):
        table.add_column(col, justify="right")
    for r in result["levels"]:
        table.add_row(
            str(r["concurrency"]),
            str(r["requests"]),
            str(r["errors"]),
            f"{r['aggregate_tok_s']:.1f}",
            fmt(r["per_stream_tok_s_p50"], digits=1),
            f"{fmt(r['ttft_s_p50'])}/{fmt(r['ttft_s_p99'])}",
            f"{fmt(r['itl_s_p50'], 1e3, 1)}/{fmt(r['itl_s_p99'], 1e3, 1)}",
            fmt(r["compile_misses"], digits=0),
        )
    return table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepserve bench",
        description=__doc__,
        epilog=OTHER_FORMS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1], help="client streams per level")
    parser.add_argument("--requests", type=int, default=3, help="requests per stream and level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--api", choices=["infer", "openai"], default="infer", help="POST /infer or /v1/completions (streamed)"
    )
    parser.add_argument("--model", help="model name to send (required by some OpenAI servers)")
    parser.add_argument("--out", type=Path, help="write the JSON result here, and the plot next to it (.png)")
    return parser


def main(argv: list[str]) -> int:
    """``stepserve bench [options]``: run the load, print the table to stderr and the JSON
    to stdout; with ``--out`` write the JSON and a PNG plot beside it. Returns 0."""
    args = _parser().parse_args(argv)
    result = run(args.url, args.concurrency, args.requests, args.max_tokens, args.api, args.model)
    result.update(
        command="stepserve bench " + " ".join(argv),
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **machine_info(),
    )
    print_table(_table(result))
    if args.out:
        plot = plot_levels({result["url"]: result}, args.out.with_suffix(".png"), f"stepserve bench: {result['url']}")
        result["plot"] = str(plot) if plot else None
        args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0
