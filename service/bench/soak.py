"""Soak test: a bounded run of mixed load against a stepserve on loopback, reported as JSON.

``python -m service.bench.soak`` (or ``stepserve soak``) starts ``stepserve serve`` on a free
loopback port with every batch bucket warmed up (``--warmup-batch`` = the largest batch
bucket; settings come from the same environment and ``--config`` as ``serve``), then runs
``--concurrency`` streaming clients (default: twice the largest batch bucket) for
``--duration`` seconds, each sending prompts of mixed lengths to ``/infer`` back to back.
``--url`` soaks a server already running on loopback instead (``--pid`` adds its RSS).

Reported: requests by outcome (429s are the intended back-pressure and are retried after
``Retry-After``; anything else that is not a finished 200 is an error), compile misses after
warm-up (from ``/metrics``), MLX active memory and process RSS under load (medians over the
first window once the load settled and over the last one, with their drift in percent) and
idle before and after, and TTFT p50/p99 per time window. Requests still in flight at the
deadline are finished, so a run lasts up to one request longer than ``--duration``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families

from service.api.security import is_loopback
from service.bench.compare import free_port
from service.config import load_settings

PROMPT_TOKENS = (8, 24, 48, 100, 200, 400)  # roughly one token per word; all within warm-up's 512
WORDS = ("river", "stone", "market", "harbour", "lantern", "winter", "garden", "letter", "engine", "valley")
GOALS = {"errors": 0, "compile_misses_after_warmup": 0, "memory_drift_pct": 5.0}


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
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if len(self.error_samples) < 10:
            self.error_samples.append(f"{kind}: {detail[:300]}")


def prompt(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


async def client(
    http: httpx.AsyncClient, rng: random.Random, deadline: float, t0: float, tally: Tally, max_tokens: int
) -> None:
    """Send streamed ``/infer`` requests back to back until ``deadline`` (monotonic seconds)."""
    while time.monotonic() < deadline:
        body = {
            "prompt": prompt(rng, rng.choice(PROMPT_TOKENS)),
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
        if final is None or final["finish_reason"] not in ("stop", "length"):
            tally.error(f"finish_{final and final['finish_reason']}", json.dumps(final))
            continue
        tally.ok += 1
        tally.tokens += final["usage"]["completion_tokens"]
        tally.ttft.append((time.monotonic() - t0, first - start))


def scrape(url: str) -> dict[str, float]:
    """Compile misses, MLX active memory and live requests from ``/metrics``."""
    wanted = {
        "stepserve_compile_cache_misses_total": "compile_misses",
        "stepserve_mlx_active_memory_bytes": "mlx_active_bytes",
        "stepserve_requests_running": "running",
        "stepserve_requests_waiting": "waiting",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += sample.value
    return out


def rss_bytes(pid: int | None) -> int | None:
    """Resident set size of ``pid`` (``ps``, Linux and macOS), or None."""
    if pid is None:
        return None
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return int(out) * 1024 if out else None


async def sampler(url: str, pid: int | None, deadline: float, t0: float, every_s: float, samples: list[dict]) -> None:
    while time.monotonic() < deadline:
        metrics = await asyncio.to_thread(scrape, url)
        samples.append({"t_s": round(time.monotonic() - t0, 1), **metrics, "rss_bytes": rss_bytes(pid)})
        await asyncio.sleep(every_s)


def settle_idle(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """:func:`scrape` once nothing runs or waits any more (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (metrics := scrape(url))["running"] + metrics["waiting"] > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    return metrics


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def drift(samples: list[dict], key: str, settle_s: float, window_s: float) -> dict:
    """Median of ``key`` over the first window once the load settled and over the last
    window, and the change in percent (medians: memory moves with every batch change)."""
    values = [(s["t_s"], s[key]) for s in samples if s[key] is not None]
    if not values:
        return {"settled": None, "end": None, "drift_pct": None}
    last = values[-1][0]
    first = [v for t, v in values if settle_s <= t < settle_s + window_s] or [values[0][1]]
    final = [v for t, v in values if t > last - window_s]
    start, end = percentile(first, 0.5), percentile(final, 0.5)
    return {"settled": start, "end": end, "drift_pct": round(100 * (end - start) / start, 2) if start else None}


async def load(url: str, pid: int | None, args: argparse.Namespace) -> tuple[Tally, list[dict], float]:
    """Run the clients and the sampler for ``args.duration`` seconds; returns what the
    clients saw, the samples, and the seconds it took."""
    tally, samples, rng = Tally(), [], random.Random(args.seed)
    t0 = time.monotonic()
    deadline = t0 + args.duration
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=10), limits=limits) as http:
        clients = [
            client(http, random.Random(rng.random()), deadline, t0, tally, args.max_tokens)
            for _ in range(args.concurrency)
        ]
        await asyncio.gather(sampler(url, pid, deadline, t0, args.sample_s, samples), *clients)
    return tally, samples, time.monotonic() - t0


def soak(url: str, pid: int | None, args: argparse.Namespace) -> dict:
    """Soak ``url`` as ``args`` say and return the report (see the module docstring)."""
    idle, idle_rss = scrape(url), rss_bytes(pid)
    tally, samples, elapsed = asyncio.run(load(url, pid, args))
    end = settle_idle(url)
    end_rss = rss_bytes(pid)
    settle = args.settle_s if args.settle_s is not None else min(60.0, args.duration / 5)
    windows = []
    for w0 in range(0, int(elapsed) + 1, int(args.window_s)):
        ttfts = [v for t, v in tally.ttft if w0 <= t < w0 + args.window_s]
        windows.append(
            {
                "from_s": w0,
                "to_s": w0 + args.window_s,
                "requests": len(ttfts),
                "ttft_p50_s": percentile(ttfts, 0.5),
                "ttft_p99_s": percentile(ttfts, 0.99),
            }
        )
    memory = {key: drift(samples, key, settle, args.window_s) for key in ("mlx_active_bytes", "rss_bytes")}
    report = {
        "url": url,
        "duration_s": round(elapsed, 1),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "requests": {
            "ok": tally.ok,
            "rejected_429": tally.rejected_429,
            "errors": sum(tally.errors.values()),
            "errors_by_kind": tally.errors,
        },
        "error_samples": tally.error_samples,
        "tokens_per_s": round(tally.tokens / elapsed, 2),
        "compile_misses_after_warmup": end["compile_misses"] - idle["compile_misses"],
        "memory": {
            **memory,
            "idle_before_and_after": {
                "mlx_active_bytes": [idle["mlx_active_bytes"], end["mlx_active_bytes"]],
                "rss_bytes": [idle_rss, end_rss],
            },
        },
        "ttft_p99_s": percentile([v for _, v in tally.ttft], 0.99),
        "ttft_by_window": windows,
        "samples": samples,
    }
    report["goals_met"] = {
        "no_errors": report["requests"]["errors"] == GOALS["errors"],
        "no_compile_misses": report["compile_misses_after_warmup"] == GOALS["compile_misses_after_warmup"],
        "memory_flat": all(
            abs(m["drift_pct"]) <= GOALS["memory_drift_pct"] for m in memory.values() if m["drift_pct"] is not None
        ),
    }
    return report


def start_server(largest_batch: int, serve_args: list[str]) -> tuple[subprocess.Popen, str, Path]:
    """``stepserve serve`` on a free loopback port with every batch bucket warmed, logging to
    a temporary file; waits for /readyz. Returns (process, URL, log path)."""
    port = free_port()
    stepserve = str(Path(sys.executable).parent / "stepserve")
    log = Path(tempfile.mkstemp(prefix="stepserve-soak-", suffix=".log")[1])
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                stepserve,
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--warmup-batch",
                str(largest_batch),
                *serve_args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"stepserve exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return proc, url, log
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepserve soak", description=__doc__.split("\n\n")[0])
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
    args = parser.parse_args(argv)
    settings = load_settings(args.config)
    largest_batch = settings.served_models()[0].batch_buckets[-1]
    args.concurrency = args.concurrency or 2 * largest_batch
    proc, pid = None, args.pid
    if args.url:
        if not is_loopback(urlparse(args.url).hostname or ""):
            print("stepserve soak: --url must be a loopback address (127.0.0.1, ::1 or localhost)", file=sys.stderr)
            return 2
        url = args.url.rstrip("/")
    else:
        config = ["--config", args.config] if args.config else []
        proc, url, log = start_server(largest_batch, config + args.serve_args)
        pid = proc.pid
        print(f"stepserve soak: serving at {url}, log {log}", file=sys.stderr)
    try:
        report = soak(url, pid, args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(120)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all(report["goals_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
