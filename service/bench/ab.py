"""``stepserve bench ab``: two running servers, the same requests, one at a time, alternating.

Measures A against B (e.g. speculation off against prompt lookup) where the machine is shared
with other work: each request goes to both servers back to back, in alternating order, so both
see the same background load on average (a run per server, one after the other, does not).
Requests are greedy and not streamed (``/v1/chat/completions``); per server and workload the
result has the completion tokens, the seconds (arrival to answer: prefill included), tokens/s,
and whether every answer was the same text on both servers.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
from rich.table import Table

from service.bench.common import report
from service.bench.load import Workload


def run(urls: dict[str, str], workloads: list[str], requests: int, max_tokens: int, tokens: int) -> dict:
    """Send ``requests`` requests of each workload to every server in ``urls`` ({name: URL}),
    alternating which goes first. Raises httpx.HTTPError when a server does not answer."""
    results: dict[str, dict] = {}
    with httpx.Client(timeout=3600) as client:
        for name in workloads:
            work = Workload(name, max_tokens=max_tokens, model="model", system_tokens=tokens)
            texts: dict[str, list[str]] = {s: [] for s in urls}
            totals = {s: [0, 0.0] for s in urls}
            for i in range(requests):
                path, body = work.request(i)
                body = {**body, "stream": False}
                body.pop("stream_options", None)
                for server in list(urls)[:: 1 if i % 2 else -1]:
                    start = time.perf_counter()
                    reply = client.post(urls[server] + path, json=body).json()
                    totals[server][1] += time.perf_counter() - start
                    totals[server][0] += reply["usage"]["completion_tokens"]
                    texts[server].append(reply["choices"][0]["message"]["content"])
            answers = list(texts.values())
            results[name] = {
                "servers": {s: {"tokens": n, "seconds": t, "tok_s": n / t} for s, (n, t) in totals.items()},
                "same_text": all(a == answers[0] for a in answers),
            }
    return {"urls": urls, "requests": requests, "max_tokens": max_tokens, "workloads": results}


def main(argv: list[str]) -> int:
    """``stepserve bench ab --a NAME=URL --b NAME=URL [options]``; prints a table and the JSON."""
    parser = argparse.ArgumentParser(prog="stepserve bench ab", description=__doc__)
    parser.add_argument("--a", required=True, help="NAME=URL of the first server (e.g. off=http://127.0.0.1:8000)")
    parser.add_argument("--b", required=True, help="NAME=URL of the second")
    parser.add_argument("--workload", nargs="+", choices=["copy", "chat"], default=["copy", "chat"])
    parser.add_argument("--requests", type=int, default=4, help="requests per workload (each to both servers)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--system-tokens", type=int, default=120, help="copy: each passage's size in tokens, about")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    urls = dict(x.split("=", 1) for x in (args.a, args.b))
    result = run(urls, args.workload, args.requests, args.max_tokens, args.system_tokens)
    table = Table(title="stepserve bench ab (same requests, alternating)")
    for col in ("workload", "server", "tokens", "seconds", "tok/s", "same text"):
        table.add_column(col, justify="right")
    for name, r in result["workloads"].items():
        for server, f in r["servers"].items():
            figures = (str(f["tokens"]), f"{f['seconds']:.2f}", f"{f['tok_s']:.2f}")
            table.add_row(name, server, *figures, str(r["same_text"]))
    return report(result, ["ab", *argv], [table], args.out)
