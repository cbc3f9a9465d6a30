"""``stepserve bench``: measure a running server from the outside, over HTTP.

This first version drives one stream (requests one after another) against ``POST /infer``
and reports TTFT, decode tokens/s and end-to-end tokens/s, plus the compile-cache misses
the server counted during the run. Results go to stdout as a table and to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

# A prompt the default model continues for a long time without an end-of-sequence token.
DEFAULT_PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"


def scrape(client: httpx.Client, name: str) -> tuple[float, dict[str, str]]:
    """(sum of a metric's samples, labels of its first sample) from ``/metrics``."""
    total, labels = 0.0, {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
                labels = labels or dict(sample.labels)
    return total, labels


def run_single_stream(url: str, requests: int, max_tokens: int, prompt: str) -> dict:
    """Send ``requests`` greedy requests one at a time; return per-request and summary figures.

    Units: seconds and tokens per second. ``decode_tok_s`` excludes the first token
    (it comes from prefill); ``e2e_tok_s`` is completion tokens over total request time.
    """
    with httpx.Client(base_url=url, timeout=600) as client:
        if client.get("/readyz").status_code != 200:
            raise SystemExit(f"{url} is not ready (GET /readyz is not 200)")
        misses_before, _ = scrape(client, "stepserve_compile_cache_misses_total")
        _, build = scrape(client, "stepserve_build_info")
        runs = []
        for _ in range(requests):
            start = time.perf_counter()
            reply = client.post("/infer", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
            wall = time.perf_counter() - start
            reply.raise_for_status()
            body = reply.json()
            tokens, t = body["usage"]["completion_tokens"], body["timings"]
            runs.append({
                "completion_tokens": tokens,
                "ttft_s": t["ttft_s"],
                "decode_tok_s": (tokens - 1) / t["decode_s"] if t["decode_s"] > 0 else None,
                "e2e_tok_s": tokens / wall,
            })
        misses_after, _ = scrape(client, "stepserve_compile_cache_misses_total")
    summary = {k: statistics.median(r[k] for r in runs if r[k] is not None) for k in ("ttft_s", "decode_tok_s", "e2e_tok_s")}
    return {
        "url": url,
        "build": build,
        "requests": requests,
        "max_tokens": max_tokens,
        "median": summary,
        "compile_misses_during_run": misses_after - misses_before,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepserve bench", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    args = parser.parse_args(argv)
    result = run_single_stream(args.url, args.requests, args.max_tokens, args.prompt)
    result.update(command="stepserve bench " + " ".join(argv if argv is not None else sys.argv[2:]),
                  machine={"platform": platform.platform(), "processor": platform.machine()}, time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    table = Table(title=f"single stream against {args.url}")
    for col in ("TTFT p50 (s)", "decode tok/s p50", "e2e tok/s p50", "compile misses"):
        table.add_column(col, justify="right")
    m = result["median"]
    table.add_row(f"{m['ttft_s']:.3f}", f"{m['decode_tok_s']:.1f}", f"{m['e2e_tok_s']:.1f}", f"{result['compile_misses_during_run']:.0f}")
    Console(stderr=True).print(table)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0
