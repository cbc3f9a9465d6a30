"""``stepserve bench group``: what splitting a model over ranks costs through the real server.

Alternating rounds of one ``stepserve serve`` and one ``stepserve launch`` group of ``--ranks``
ranks (``mlx.launch``, ring backend over 127.0.0.1; or the hosts of ``--hostfile``, run from
its first host), the same model and settings (``--`` passes more serve options to both), each
serving the same greedy streamed load
(:func:`service.bench.load.run`: the essay prompts on ``/infer``, ``--max-tokens`` each, one
untimed pass per level first). Reported per level, the median over rounds of: the engine's
mean decode step (``stepserve_step_seconds{phase="decode"}``: queueing a step to reading its
tokens back, rank 0's view, which includes every rank's stage and the hops), the client's
inter-token latency p50 and TTFT p50, aggregate tokens/s and the warm-up's seconds; and the
split's overhead per decode step (group minus one process). Figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import httpx
from rich.table import Table

from service.bench.common import fmt, report
from service.bench.load import Workload, run
from service.bench.servers import STEPSERVE_SERVE, free_ports, serving

STEP_SUM, STEP_COUNT = "stepserve_step_seconds_sum", "stepserve_step_seconds_count"


def _decode_step_s(url: str) -> tuple[float, float]:
    """(seconds, steps) of decode steps the server has counted so far."""
    with httpx.Client(base_url=url, timeout=30) as client:
        text = client.get("/metrics").text
    total, count = 0.0, 0.0
    for line in text.splitlines():
        if line.startswith((STEP_SUM, STEP_COUNT)) and 'phase="decode"' in line:
            value = float(line.rsplit(" ", 1)[1])
            total, count = (total + value, count) if line.startswith(STEP_SUM) else (total, count + value)
    return total, count


def _measure(url: str, args: argparse.Namespace) -> list[dict]:
    """Each level's figures against the server at ``url``, with its mean decode step."""
    out = []
    for level in args.concurrency:
        before = _decode_step_s(url)
        result = run(url, [level], args.requests, Workload(max_tokens=args.max_tokens), warmup_requests=1)
        after = _decode_step_s(url)
        steps = after[1] - before[1]
        figures = result["levels"][0]  # the decode steps counted include the untimed pass's (the same load)
        out.append({**figures, "decode_steps": steps, "decode_step_s_mean": (after[0] - before[0]) / steps})
    return out


def _commands(args: argparse.Namespace, serve: list[str]) -> dict[str, list[str]]:
    group = [str(Path(STEPSERVE_SERVE[0]).parent / "stepserve"), "launch"]
    if args.hostfile:  # real hosts: rank 0 here (the hostfile's first host), the others over ssh
        group += ["--hostfile", str(args.hostfile), "--"]
        return {"one process": [*STEPSERVE_SERVE, *serve], "group": [*group, *serve]}
    ring = free_ports(args.ranks)  # rank r listens on ring + r
    group += ["--backend", "ring", "-n", str(args.ranks), "--hosts", "127.0.0.1", "--starting-port", str(ring)]
    return {"one process": [*STEPSERVE_SERVE, *serve], f"{args.ranks} ranks": [*group, "--", *serve]}


def _median(rounds: list[dict[str, list[dict]]], name: str, i: int, key: str) -> float | None:
    values = [r[name][i][key] for r in rounds if r[name][i][key] is not None]
    return statistics.median(values) if values else None


def main(argv: list[str]) -> int:
    """``stepserve bench group ...``; prints a table to stderr and JSON to stdout."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="stepserve bench group", description=__doc__)
    parser.add_argument("--ranks", type=int, default=2, help="ranks on this host (ring over 127.0.0.1)")
    parser.add_argument(
        "--hostfile", type=Path, default=None, help="an mlx.launch hostfile instead: the group on those hosts"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=3, help="timed requests per stream and level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of one process and the group")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv[:split])
    serve = argv[split + 1 :]
    rounds: list[dict[str, list[dict]]] = []
    with tempfile.TemporaryDirectory(prefix="stepserve-bench-group-") as tmp:
        for i in range(args.rounds):
            done: dict[str, list[dict]] = {}
            for name, command in _commands(args, serve).items():
                log = Path(tmp) / f"{name.replace(' ', '-')}-{i}.log"
                with serving(name, command, "/readyz", log) as (url, _):
                    models = httpx.get(f"{url}/readyz", timeout=30).json()["models"]
                    warmup_s = next(iter(models.values()))["warmup_s"]
                    done[name] = [{**level, "warmup_s": warmup_s} for level in _measure(url, args)]
            rounds.append(done)
    names = list(rounds[0])
    keys = ("decode_step_s_mean", "itl_s_p50", "ttft_s_p50", "aggregate_tok_s", "warmup_s")
    levels = [
        {"concurrency": level, **{f"{n} {k}": _median(rounds, n, i, k) for n in names for k in keys}}
        for i, level in enumerate(args.concurrency)
    ]
    for level in levels:
        one, group = level[f"{names[0]} decode_step_s_mean"], level[f"{names[1]} decode_step_s_mean"]
        level["decode_step_overhead_s"] = group - one if one is not None and group is not None else None
    table = Table(title=f"stepserve bench group: one process against {names[1]} (medians of {args.rounds})")
    columns = ["streams", *(f"{n}: decode step ms" for n in names), "overhead ms"]
    for col in [*columns, *(f"{n}: ITL p50 ms" for n in names)]:
        table.add_column(col, justify="right")
    for level in levels:
        table.add_row(
            str(level["concurrency"]),
            *(fmt(level[f"{n} decode_step_s_mean"], 1e3, 1) for n in names),
            fmt(level["decode_step_overhead_s"], 1e3, 1),
            *(fmt(level[f"{n} itl_s_p50"], 1e3, 1) for n in names),
        )
    result = {
        "what": __doc__.split("\n\n")[0] if __doc__ else "",
        "serve_options": serve,
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),  # both servers inherit it
        "load_average_at_end": os.getloadavg(),
        "levels": levels,
    }
    return report({**result, "rounds": rounds}, ["group", *argv], [table], args.out)
