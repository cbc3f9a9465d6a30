"""``stepserve soak``: a bounded run of mixed load against a stepserve on loopback, as JSON.

It starts ``stepserve serve`` on a free loopback port with every batch bucket warmed up
(``--warmup-batch`` = the largest batch bucket; settings come from the same environment and
``--config`` as ``serve``; output to a temporary log file), then runs
``--concurrency`` streaming clients (default: twice the largest batch bucket) for
``--duration`` seconds, each sending prompts of mixed lengths to ``/infer`` back to back.
``--url`` soaks a server already running on loopback instead (``--pid`` adds its RSS).

Reported: requests by outcome (429s are the intended back-pressure and are retried after
``Retry-After``; anything else that is not a finished 200 is an error), compile misses after
warm-up (from ``/metrics``), MLX active memory and process RSS under load (medians over the
first window once the load settled and over the last one, with their drift in percent) and
idle before and after, and TTFT p50/p99 per time window. Requests still in flight at the
deadline are finished, so a run lasts up to one request longer than ``--duration``.
Measured soaks: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

from service.api.security import is_loopback
from service.bench.common import percentile, scrape, word_prompt
from service.bench.servers import STEPSERVE_SERVE, serving
from service.config import load_settings

PROMPT_TOKENS = (8, 24, 48, 100, 200, 400)  # roughly one token per word; all within warm-up's 512
GOALS = {"errors": 0, "compile_misses_after_warmup": 0, "memory_drift_pct": 5.0}
METRICS = {  # /metrics name -> sample key
    "stepserve_compile_cache_misses_total": "compile_misses",
    "stepserve_mlx_active_memory_bytes": "mlx_active_bytes",
    "stepserve_requests_running": "running",
    "stepserve_requests_waiting": "waiting",
}


@dataclass
class Tally:
    """What the clients saw; times are seconds since the soak started."""

    ok: int = 0
    rejected_429: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (finished at, TTFT)
    tokens: int = 0

    def error(self, kind: str, detail: str) -> None:
        """Count one error of ``kind``; keep the first 10 details (300 characters each)."""
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if len(self.error_samples) < 10:
            self.error_samples.append(f"{kind}: {detail[:300]}")


async def client(
    http: httpx.AsyncClient, rng: random.Random, deadline: float, t0: float, tally: Tally, max_tokens: int
) -> None:
    """Send streamed ``/infer`` requests back to back until ``deadline`` (monotonic seconds)."""
    while time.monotonic() < deadline:
        body = {
            "prompt": word_prompt(rng, rng.choice(PROMPT_TOKENS)),
            "max_tokens": rng.randint(max_tokens // 4, max_tokens),
            "temperature": rng.choice((0.0, 0.7)),
            "stream": True,
        }
        start, first = time.monotonic(), None
        try:
            async with http.stream("POST", "/infer", json=body) as reply:
                if reply.status_code == 429:
                    tally.rejected_429 += 1
                    await asyncio.sleep(float(reply.headers.get("retry-after", "1")))
                    continue
                if reply.status_code != 200:
                    tally.error(f"http_{reply.status_code}", (await reply.aread()).decode(errors="replace"))
                    continue
                final = None
                async for line in reply.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    first = first or time.monotonic()
                    event = json.loads(line[6:])
                    final = event if event.get("finish_reason") else final
        except httpx.HTTPError as exc:
            tally.error(type(exc).__name__, str(exc))
            continue
        if first is None or final is None or final["finish_reason"] not in ("stop", "length"):
            tally.error(f"finish_{final and final['finish_reason']}", json.dumps(final))
            continue
        tally.ok += 1
        tally.tokens += final["usage"]["completion_tokens"]
        tally.ttft.append((time.monotonic() - t0, first - start))


def read_metrics(http: httpx.Client) -> dict[str, float]:
    """Compile misses, MLX active memory (bytes) and live requests from ``/metrics``, keyed as
    in :data:`METRICS`. Raises httpx.HTTPError."""
    totals = scrape(http, METRICS)
    return {key: totals[name] for name, key in METRICS.items()}


def rss_bytes(pid: int | None) -> int | None:
    """Resident set size of ``pid`` (``ps``, Linux and macOS), or None."""
    if pid is None:
        return None
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return int(out) * 1024 if out else None


async def sampler(
    http: httpx.Client, pid: int | None, deadline: float, t0: float, every_s: float, samples: list[dict]
) -> None:
    """Every ``every_s`` seconds until ``deadline`` (monotonic), append to ``samples`` the
    seconds since ``t0``, :func:`read_metrics` (in a thread) and the server's RSS."""
    while time.monotonic() < deadline:
        metrics = await asyncio.to_thread(read_metrics, http)
        samples.append({"t_s": round(time.monotonic() - t0, 1), **metrics, "rss_bytes": rss_bytes(pid)})
        await asyncio.sleep(every_s)


def settle_idle(http: httpx.Client, timeout_s: float = 60.0) -> dict[str, float]:
    """:func:`read_metrics` once nothing runs or waits any more (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (metrics := read_metrics(http))["running"] + metrics["waiting"] > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    return metrics


def drift(samples: list[dict], key: str, settle_s: float, window_s: float) -> dict:
    """Median of ``key`` over the first window once the load settled and over the last
    window, and the change in percent (medians: memory moves with every batch change)."""
    values = [(s["t_s"], s[key]) for s in samples if s[key] is not None]
    if not values:
        return {"settled": None, "end": None, "drift_pct": None}
    last = values[-1][0]
    first = [v for t, v in values if settle_s <= t < settle_s + window_s] or [values[0][1]]
    final = [v for t, v in values if t > last - window_s]
    start, end = statistics.median(first), statistics.median(final)
    return {"settled": start, "end": end, "drift_pct": round(100 * (end - start) / start, 2) if start else None}


async def load(
    url: str, http: httpx.Client, pid: int | None, args: argparse.Namespace
) -> tuple[Tally, list[dict], float]:
    """Run the clients and the sampler for ``args.duration`` seconds; returns what the
    clients saw, the samples, and the seconds it took."""
    tally, samples, rng = Tally(), [], random.Random(args.seed)
    t0 = time.monotonic()
    deadline = t0 + args.duration
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10), limits=limits) as stream:
        clients = [
            client(stream, random.Random(rng.random()), deadline, t0, tally, args.max_tokens)
            for _ in range(args.concurrency)
        ]
        await asyncio.gather(sampler(http, pid, deadline, t0, args.sample_s, samples), *clients)
    return tally, samples, time.monotonic() - t0


def ttft_windows(ttft: list[tuple[float, float]], elapsed: float, window_s: float) -> list[dict]:
    """TTFT p50/p99 (seconds) of the requests that finished in each ``window_s`` window;
    ``ttft`` holds (finished at, TTFT) pairs in seconds since the soak started."""
    windows = []
    for w0 in range(0, int(elapsed) + 1, int(window_s)):
        ttfts = [v for t, v in ttft if w0 <= t < w0 + window_s]
        windows.append(
            {
                "from_s": w0,
                "to_s": w0 + window_s,
                "requests": len(ttfts),
                "ttft_p50_s": percentile(ttfts, 0.5),
                "ttft_p99_s": percentile(ttfts, 0.99),
            }
        )
    return windows


def soak(url: str, pid: int | None, args: argparse.Namespace) -> dict:
    """Soak ``url`` as ``args`` say and return the report (see the module docstring).
    Raises httpx.HTTPError when ``/metrics`` does not answer."""
    with httpx.Client(base_url=url, timeout=30) as http:
        idle, idle_rss = read_metrics(http), rss_bytes(pid)
        tally, samples, elapsed = asyncio.run(load(url, http, pid, args))
        end, end_rss = settle_idle(http), rss_bytes(pid)
    settle = args.settle_s if args.settle_s is not None else min(60.0, args.duration / 5)
    memory = {key: drift(samples, key, settle, args.window_s) for key in ("mlx_active_bytes", "rss_bytes")}
    errors = sum(tally.errors.values())
    misses = end["compile_misses"] - idle["compile_misses"]
    return {
        "url": url,
        "duration_s": round(elapsed, 1),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "requests": {
            "ok": tally.ok,
            "rejected_429": tally.rejected_429,
            "errors": errors,
            "errors_by_kind": tally.errors,
        },
        "error_samples": tally.error_samples,
        "tokens_per_s": round(tally.tokens / elapsed, 2),
        "compile_misses_after_warmup": misses,
        "memory": {
            **memory,
            "idle_before_and_after": {
                "mlx_active_bytes": [idle["mlx_active_bytes"], end["mlx_active_bytes"]],
                "rss_bytes": [idle_rss, end_rss],
            },
        },
        "ttft_p99_s": percentile([v for _, v in tally.ttft], 0.99),
        "ttft_by_window": ttft_windows(tally.ttft, elapsed, args.window_s),
        "samples": samples,
        "goals_met": {
            "no_errors": errors == GOALS["errors"],
            "no_compile_misses": misses == GOALS["compile_misses_after_warmup"],
            "memory_flat": all(
                abs(m["drift_pct"]) <= GOALS["memory_drift_pct"] for m in memory.values() if m["drift_pct"] is not None
            ),
        },
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepserve soak", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--url", help="soak this loopback server instead of starting one")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    parser.add_argument("--config", help="TOML settings, as for serve (default: $STEPSERVE_CONFIG)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--concurrency", type=int, help="clients (default: twice the largest batch bucket)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens drawn from [N/4, N] (default 64)")
    parser.add_argument("--window-s", type=float, default=60.0, help="TTFT window in seconds (default 60)")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between /metrics and RSS samples")
    parser.add_argument(
        "--settle-s", type=float, help="memory is compared from this second on (default: min(60, duration/5))"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the JSON report here too")
    parser.add_argument("serve_args", nargs="*", help="after --: extra `stepserve serve` arguments")
    return parser


def main(argv: list[str]) -> int:
    """``stepserve soak [options] [-- serve options]``: print the JSON report (and write it to
    ``--out``). Returns 0 when every goal is met, 1 when one is missed, 2 for a non-loopback
    ``--url``; raises SystemExit when the server it starts does not come up."""
    args = _parser().parse_args(argv)
    settings = load_settings(args.config)
    largest_batch = (settings.served_models()[0].batch_buckets or settings.batch_buckets)[-1]
    args.concurrency = args.concurrency or 2 * largest_batch
    if args.url:
        if not is_loopback(urlparse(args.url).hostname or ""):
            print("stepserve soak: --url must be a loopback address (127.0.0.1, ::1 or localhost)", file=sys.stderr)
            return 2
        server = nullcontext((args.url.rstrip("/"), args.pid))
    else:
        config = ["--config", args.config] if args.config else []
        command = [*STEPSERVE_SERVE, "--host", "127.0.0.1", "--warmup-batch", str(largest_batch), *config]
        log = Path(tempfile.mkstemp(prefix="stepserve-soak-", suffix=".log")[1])
        print(f"stepserve soak: starting a server, log {log}", file=sys.stderr)
        server = serving("stepserve", [*command, *args.serve_args], "/readyz", log)
    with server as (url, pid):
        print(f"stepserve soak: soaking {url} for {args.duration:g} s", file=sys.stderr)
        report = soak(url, pid, args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all(report["goals_met"].values()) else 1
