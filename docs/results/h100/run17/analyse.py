"""Runs 17-19's analysis: ``python3 analyse.py NAME...`` in a results folder pairs each request of
NAME-client.jsonl with its line in NAME-server.jsonl (in order of arrival) and prints, in ms, the
median (mean) and max of each part of its TTFT: send (client start to the app), prep (app to its
Sequence: parsing, template, tokenizing, admission), queue (to admission), prefill (to its first
token), emit (to that token's body write), recv (to the client's first text). With one NAME, each
request's times as well (ms from the first request's start)."""

import json
import statistics
import sys


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def pairs(name: str) -> list[tuple[dict, dict]]:
    client = sorted(load(f"{name}-client.jsonl"), key=lambda c: c["start"])
    server = sorted((s for s in load(f"{name}-server.jsonl") if s.get("first")), key=lambda s: s["asgi"])
    used: set[int] = set()
    out = []
    for c in client:
        i = min(
            (i for i, s in enumerate(server) if i not in used and s["asgi"] >= c["start"]),
            key=lambda i: server[i]["asgi"],
        )
        used.add(i)
        out.append((c, server[i]))
    return out


def parts(c: dict, s: dict) -> dict[str, float]:
    body = s["bodies"][1] if len(s["bodies"]) > 1 else s["bodies"][0]
    return {
        "send": s["asgi"] - c["start"],
        "prep": s["arrival"] - s["asgi"],
        "queue": s["started"] - s["arrival"],
        "prefill": s["first"] - s["started"],
        "emit": body - s["first"],
        "recv": c["first"] - body,
        "ttft": c["first"] - c["start"],
    }


for name in sys.argv[1:]:
    rows = [parts(c, s) for c, s in pairs(name)]
    print(f"== {name}: {len(rows)} requests; ms, p50 (mean) max")
    for k in rows[0]:
        v = [r[k] * 1e3 for r in rows]
        print(f"  {k:8s} {statistics.median(v):7.1f} ({statistics.mean(v):6.1f})  max {max(v):6.1f}")
if len(sys.argv) == 2:
    ps = pairs(sys.argv[1])
    t0 = ps[0][0]["start"]
    for c, s in ps:
        times = [c["start"], s["asgi"], s["arrival"], s["started"], s["first"], s["bodies"][-1], c["first"]]
        print(" ".join(f"{(t - t0) * 1e3:7.1f}" for t in times), f"ttft {(c['first'] - c['start']) * 1e3:6.1f}")
