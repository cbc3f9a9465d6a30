"""``stepserve bench settings-ab``: two configurations of one model, A and B, each served by a
fresh ``stepserve serve`` started here, the same load against each, and B / A.

    stepserve bench settings-ab --preset prefix --serve-args="--model DIR"
    stepserve bench settings-ab --preset speculative --serve-args="--model DIR --compile on"
    stepserve bench settings-ab --a off="--prefix-cache-bytes 0" --b on="" --workload chat
    stepserve bench settings-ab --a old="" --a-dir CHECKOUT --b new="" --serve-args="--model DIR"
    stepserve bench settings-ab --preset prefix --together --rounds 12 --serve-args="--model DIR"

A and B are ``NAME=FLAGS``: extra ``stepserve serve`` flags (quoted, possibly empty) after the
``--serve-args`` both get. Write ``--serve-args=...`` with ``=`` (a value that starts with ``-``
is read as an option otherwise).

By default each round serves A and B one after the other, never both at once, alternating the
order (round 0: A then B; round 1: B then A; ...) so that a drift of the machine falls on both.
A server starts on a free loopback port as ``CMD serve SERVE_ARGS FLAGS --port PORT``; once
``/readyz`` answers 200 it gets every workload at every ``--concurrency`` level
(:func:`service.bench.load.run`: per level one untimed warm-up request per stream, then
``--requests`` timed ones per stream, greedy and streamed), then SIGTERM, and it has exited
before the next server starts.

``--together``: a GPU host's single-stream tok/s can swing by a fifth or more from one server
lifetime to the next, which sequential rounds cannot tell from a difference between A and B.
With it A starts, then B beside it on its own port (the device must hold both: a B that runs
out of memory says so; run without ``--together`` then), and both stay up for ``--rounds``
paired rounds (default 12) per workload and level, after each side's warm-up: a round is one
burst of ``level`` streams of ``--requests`` requests each (default 1) to A and one to B, one
server at a time (never both loaded at once), in orders balanced over each pair of rounds: the
first of a pair in an order drawn at random (``--seed``), the second in the other, so that with
an even ``--rounds`` each side goes first equally often (whichever goes first or second gains
or pays the same in every pair).
Per round, B / A of the burst's aggregate tok/s (one stream, one request: that request's
tok/s); reported: the geometric mean of those paired ratios, their min and max, each side's
median tok/s over rounds, each round's ratio and order, and each side's TTFT and ITL p50 pooled
over rounds; the target, when there is one, applies to the geometric mean. Both servers get
SIGTERM and have exited when the tool returns, also after an error.

``--lifetimes N`` (with ``--together``): start both servers N times, ``--rounds`` paired rounds
in each lifetime, and pool every round. A host-bound step's speed is set largely per process
(on a GPU host, two processes of the same code measured 0.75-1.0x of each other's host time
per decode step): rounds within one lifetime average out round-to-round noise, lifetimes
average out the luck of the process; the geometric mean of each lifetime's rounds is reported
beside the pooled one.

Workloads (``--workload``):

* ``chat``: the load tool's chat-shared-prefix: ``/v1/chat/completions``, a shared system prompt
  of about ``--system-tokens`` (450) tokens and a short user turn of its own per request,
  ``--chat-max-tokens`` (128) tokens out at most;
* ``long``: one generation of ``--long-max-tokens`` (512) tokens per request from a short prompt,
  ``/v1/completions`` with ``ignore_eos`` (the API's field to generate past end-of-sequence).

Each server gets the same requests in the same order. Reported per workload and level, pooled
over rounds (the timed requests of every round together; aggregate tok/s is all their completion
tokens over the level's wall times summed): aggregate tok/s, per-stream tok/s p50, TTFT p50 and
ITL p50 of A and of B, and B / A of each (tok/s: above 1, B is faster; TTFT and ITL: below 1,
B is faster), with each round's B / A of aggregate tok/s beside it; per server: seconds from
start to ready, the warm-up's seconds (from ``/readyz``, else its log), the BLAS it loaded. With
a target (a preset's, or ``--target``), whether B / A of aggregate tok/s meets it at each level.
Tables go to stderr, JSON to stdout and ``--out``; servers' logs to ``--log-dir``. With ``--together``
each workload's rounds at a level print their B / A to stderr as they end, so a run cut short
keeps what it measured.

Presets (``--a``, ``--b``, ``--concurrency``, ``--target`` given too override theirs):

* ``prefix``: A ``off`` = ``--prefix-cache-bytes 0``, B ``on`` = the defaults; chat and long at
  1 stream; target 0.97 (the prefix cache costs a single stream at most 3%);
* ``speculative``: A ``off`` = ``--speculative off``, B ``lookup`` = ``--speculative lookup``;
  chat and long at 1, 8 and 32 streams; target 1.0.

Which code a side runs:

* by default, this source tree: ``PYTHON -P -m service.cli`` (this Python; ``-P``: not the
  working directory's ``service/``) with this tree first on ``PYTHONPATH``;
* ``--a-dir DIR`` / ``--b-dir DIR``: the source tree DIR (e.g. ``git worktree add DIR COMMIT``
  of an older commit), the same way with DIR first on ``PYTHONPATH``; the working directory
  stays this one, so relative paths in the flags mean the same on both sides;
* ``--stepserve CMD`` (both) or ``--a-cmd CMD`` / ``--b-cmd CMD``: any command that takes
  ``serve FLAGS`` (e.g. another environment's ``stepserve``), run as it is, or with DIR first on
  ``PYTHONPATH`` when ``--a-dir`` / ``--b-dir`` is given too.

The JSON names each side's command, source tree and its ``git describe`` (commit, ``-dirty``
when changed).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.table import Table

from service.bench.common import Stream, fmt, level_figures, report
from service.bench.load import Workload, run
from service.bench.servers import START_TIMEOUT_S, process_blas, serving

ROOT = Path(__file__).resolve().parents[2]  # the source tree this module is part of
STEPSERVE = [sys.executable, "-P", "-m", "service.cli"]
FIGURES = ("aggregate_tok_s", "per_stream_tok_s_p50", "ttft_s_p50", "itl_s_p50")
WARMUP_LOG = re.compile(r"warm-up done: \d+ buckets in ([\d.]+) s")  # service.engine.core's log line


@dataclass(frozen=True)
class Preset:
    """A named A/B: the two sides as ``NAME=FLAGS``, the concurrency levels and the target of
    B / A aggregate tok/s."""

    label: str  # what B / A compares, before "B/A" in titles
    a: str
    b: str
    concurrency: tuple[int, ...]
    target: float


PRESETS = {
    "prefix": Preset("prefix cache ", "off=--prefix-cache-bytes 0", "on=", (1,), 0.97),
    "speculative": Preset("speculation ", "off=--speculative off", "lookup=--speculative lookup", (1, 8, 32), 1.0),
}


@dataclass(frozen=True)
class Side:
    """One configuration: ``key`` "a" or "b", its ``name``, the ``flags`` it adds to
    ``stepserve serve``, the ``command`` that runs stepserve (``serve`` is appended) and the
    ``source`` tree put first on ``PYTHONPATH`` (None: the command's own environment)."""

    key: str
    name: str
    flags: tuple[str, ...]
    command: tuple[str, ...]
    source: Path | None

    def serve_command(self, serve_args: list[str]) -> list[str]:
        """``COMMAND serve SERVE_ARGS FLAGS`` (its flags last: they override the shared ones)."""
        return [*self.command, "serve", *serve_args, *self.flags]

    def env(self) -> dict[str, str]:
        """This process's environment, with :attr:`source` first on ``PYTHONPATH``."""
        env = dict(os.environ)
        if self.source is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(self.source), env.get("PYTHONPATH"))))
        return env

    def describe(self, serve_args: list[str]) -> dict:
        """The side for the JSON: name, flags, command, source tree and its git description."""
        return {
            "name": self.name,
            "flags": shlex.join(self.flags),
            "command": shlex.join(self.serve_command(serve_args)),
            "source": str(self.source) if self.source else None,
            "commit": git_describe(self.source) if self.source else None,
        }


def make_side(key: str, spec: str, command: str | None, source: Path | None) -> Side:
    """The side ``key`` from ``NAME=FLAGS`` (``spec``; FLAGS split as a shell would, possibly
    empty), a command line (None: :data:`STEPSERVE`) and a source tree (None: this one with the
    default command, the command's own environment with another). Raises SystemExit when the
    name is empty or ``source`` has no ``service/cli.py``."""
    name, _, flags = spec.partition("=")
    if not name:
        raise SystemExit(f"--{key} '{spec}': give NAME=FLAGS, e.g. off='--prefix-cache-bytes 0'")
    if source is not None and not (source / "service" / "cli.py").is_file():
        raise SystemExit(f"--{key}-dir {source}: not a stepserve source tree (no service/cli.py)")
    if source is None and command is None:
        source = ROOT
    argv = tuple(shlex.split(command)) if command else tuple(STEPSERVE)
    return Side(key, name, tuple(shlex.split(flags)), argv, source.resolve() if source else None)


def git_describe(path: Path) -> str | None:
    """``git describe --always --dirty --abbrev=12`` of the checkout at ``path``; None where
    ``path`` is no git checkout or git is not installed."""
    try:
        out = subprocess.run(
            ["git", "-C", str(path), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def warmup_seconds(readyz: dict, log: str) -> float | None:
    """A server's warm-up seconds: the sum of ``/readyz``'s ``models.*.warmup_s``, else of the
    "warm-up done: N buckets in S s" lines of its ``log``; None when neither says."""
    models = readyz.get("models") or {}
    values = [m["warmup_s"] for m in models.values() if isinstance(m, dict) and m.get("warmup_s") is not None]
    if values:
        return sum(values)
    found = WARMUP_LOG.findall(log)
    return sum(map(float, found)) if found else None


def workloads(args: argparse.Namespace) -> dict[str, Callable[[], Workload]]:
    """{name: a maker of a fresh :class:`Workload`} for each of ``args.workload``: fresh per
    server, so every server gets the same requests in the same order."""
    chat, long = args.chat_max_tokens, args.long_max_tokens
    makers = {
        "chat": lambda: Workload("chat-shared-prefix", max_tokens=chat, system_tokens=args.system_tokens),
        "long": lambda: Workload("long", max_tokens=long),
    }
    return {name: makers[name] for name in args.workload}


Records = dict[str, dict[str, dict[int, list[Stream]]]]  # side key -> workload -> concurrency -> timed requests


def measure(side: Side, round_: int, args: argparse.Namespace, records: Records) -> dict:
    """Start ``side``'s server, wait for ready, run every workload at every level on it and
    stop it. The timed requests are added to ``records[side.key]``. Returns the server's record
    (:func:`_server_record`) with {workload: load.run() result} as ``results``. Raises
    SystemExit when the server does not get ready (with its log's tail)."""
    log = args.log_dir / f"round{round_}-{side.key}-{side.name}.log"
    command = side.serve_command(args.serve_args)
    start = time.perf_counter()
    with serving(side.name, command, "/readyz", log, args.ready_timeout_s, side.env()) as (url, pid):
        record = _server_record(side, round_, command, url, pid, time.perf_counter() - start, log)
        record["results"] = {
            name: run(url, args.concurrency, args.requests, make(), args.warmup_requests, records[side.key][name])
            for name, make in workloads(args).items()
        }
    return record


def _server_record(
    side: Side, round_: int | None, command: list[str], url: str, pid: int, ready_s: float, log: Path
) -> dict:
    """A ready server's record: round (None: up for every round), side, command, URL and
    process id, seconds to ready, warm-up seconds, ``/readyz`` (less the per-bucket list), BLAS
    and log path. Asks the server (``/readyz``, ``/proc/PID/maps``): call it while it is up."""
    readyz = httpx.get(f"{url}/readyz", timeout=60).json()
    for model in (readyz.get("models") or {}).values():
        model.pop("buckets", None)
    return {
        "round": round_,
        "side": side.key,
        "name": side.name,
        "command": shlex.join([*command, "--port", url.rsplit(":", 1)[1]]),
        "url": url,
        "pid": pid,
        "ready_s": ready_s,
        "warmup_s": warmup_seconds(readyz, log.read_text(errors="replace")),
        "readyz": readyz,
        "blas": process_blas(pid),
        "log": str(log),
    }


def schedule(rounds: int) -> list[tuple[int, str]]:
    """(round, side key) in the order the servers run: A then B in even rounds, B then A in odd."""
    return [(r, key) for r in range(rounds) for key in (("a", "b") if r % 2 == 0 else ("b", "a"))]


def ratios(a: dict, b: dict) -> dict[str, float | None]:
    """B / A of each of :data:`FIGURES` in two :func:`~service.bench.common.level_figures`;
    None where either is missing or zero."""
    return {k: b[k] / a[k] if a[k] and b[k] else None for k in FIGURES}


def pool(servers: list[dict], records: Records, target: float | None) -> dict[str, list[dict]]:
    """{workload: per level, A's and B's figures pooled over rounds (the timed requests of every
    round; errors and wall seconds summed), B / A of each figure, each round's B / A and whether
    B / A aggregate tok/s meets ``target`` (None without one)}."""
    pooled: dict[str, list[dict]] = {}
    for name in records["a"]:
        rows = []
        for level in records["a"][name]:
            per_round = {side: _levels(servers, side, name, level) for side in ("a", "b")}
            figures = {
                side: level_figures(
                    records[side][name][level],
                    sum(r["errors"] for r in per_round[side]),
                    sum(r["elapsed_s"] for r in per_round[side]),
                )
                for side in ("a", "b")
            }
            ratio = ratios(figures["a"], figures["b"])
            met = None if target is None or ratio["aggregate_tok_s"] is None else ratio["aggregate_tok_s"] >= target
            by_round = [ratios(a, b) for a, b in zip(per_round["a"], per_round["b"], strict=True)]
            rows.append(
                {"concurrency": level, **figures, "b_over_a": ratio, "b_over_a_by_round": by_round, "target_met": met}
            )
        pooled[name] = rows
    return pooled


def _levels(servers: list[dict], side: str, workload: str, level: int) -> list[dict]:
    """``side``'s figures of ``workload`` at ``level`` in each round, in round order."""
    return [
        r
        for s in sorted(servers, key=lambda s: s["round"])
        if s["side"] == side
        for r in s["results"][workload]["levels"]
        if r["concurrency"] == level
    ]


def _workload_table(name: str, rows: list[dict], a: Side, b: Side, title: str) -> Table:
    table = Table(title=f"{title}: {name} (pooled over rounds; B = {b.name}, A = {a.name})")
    columns = ("streams", "agg tok/s A/B", "B/A", "per-stream tok/s A/B", "B/A", "TTFT p50 ms A/B", "B/A")
    for col in (*columns, "ITL p50 ms A/B", "B/A", "agg B/A by round", "tokens A/B", "errors A/B", "target met"):
        table.add_column(col, justify="right")
    for r in rows:
        fa, fb, q = r["a"], r["b"], r["b_over_a"]
        table.add_row(
            str(r["concurrency"]),
            f"{fmt(fa['aggregate_tok_s'], digits=1)}/{fmt(fb['aggregate_tok_s'], digits=1)}",
            fmt(q["aggregate_tok_s"]),
            f"{fmt(fa['per_stream_tok_s_p50'], digits=1)}/{fmt(fb['per_stream_tok_s_p50'], digits=1)}",
            fmt(q["per_stream_tok_s_p50"]),
            f"{fmt(fa['ttft_s_p50'], 1e3, 1)}/{fmt(fb['ttft_s_p50'], 1e3, 1)}",
            fmt(q["ttft_s_p50"]),
            f"{fmt(fa['itl_s_p50'], 1e3, 2)}/{fmt(fb['itl_s_p50'], 1e3, 2)}",
            fmt(q["itl_s_p50"]),
            " ".join(fmt(x["aggregate_tok_s"]) for x in r["b_over_a_by_round"]),
            f"{fa['completion_tokens']}/{fb['completion_tokens']}",
            f"{fa['errors']}/{fb['errors']}",
            {True: "yes", False: "no", None: "-"}[r["target_met"]],
        )
    return table


def _server_table(servers: list[dict], sides: dict[str, dict]) -> Table:
    table = Table(title="servers, in the order they started")
    for col in ("round", "side", "server", "ready s", "warm-up s", "BLAS", "source"):
        table.add_column(col, justify="right")
    for s in servers:
        side = sides[s["side"]]
        source = side["commit"] or side["source"] or side["command"]
        row = (s["side"].upper(), s["name"], fmt(s["ready_s"], digits=1), fmt(s["warmup_s"], digits=1), s["blas"])
        table.add_row("all" if s["round"] is None else str(s["round"]), *row, source)
    return table


# --together: both servers up at once, paired rounds.

OUT_OF_MEMORY = re.compile(  # MLX's "[malloc] Unable to allocate", CUDA's "out of memory", stepserve's budget check
    r"out of memory|unable to allocate|insufficient memory|not enough memory|MemoryError|MemoryBudgetError|bad_alloc"
    r"|exited with -9\b",  # SIGKILL: on Linux, most likely the kernel's OOM killer
    re.IGNORECASE,
)


def paired_statistics(a: Sequence[float | None], b: Sequence[float | None]) -> dict:
    """Paired B / A over rounds: ``a[i]`` and ``b[i]`` are round i's tok/s of A and of B (None
    or 0: no tokens that round).

    Returns ``rounds`` (the rounds where both sides have tok/s), ``paired_ratio_geomean`` (the
    geometric mean of ``b[i] / a[i]`` over those rounds: the exponential of the mean log ratio,
    so A / B's is its inverse, ``statistics.geometric_mean``), ``paired_ratio_min`` and
    ``paired_ratio_max``, ``a_tok_s_median`` and ``b_tok_s_median`` (each side's median over its
    rounds with tok/s) and ``ratio_by_round`` (None where a side had none); None where no round
    counts. Raises ValueError when ``a`` and ``b`` differ in length."""
    by_round = [y / x if x and y else None for x, y in zip(a, b, strict=True)]
    ratios = [r for r in by_round if r is not None]
    a_ok, b_ok = [x for x in a if x], [y for y in b if y]
    return {
        "rounds": len(ratios),
        "paired_ratio_geomean": statistics.geometric_mean(ratios) if ratios else None,
        "paired_ratio_min": min(ratios, default=None),
        "paired_ratio_max": max(ratios, default=None),
        "a_tok_s_median": statistics.median(a_ok) if a_ok else None,
        "b_tok_s_median": statistics.median(b_ok) if b_ok else None,
        "ratio_by_round": by_round,
    }


def measure_together(sides: dict[str, Side], args: argparse.Namespace) -> tuple[list[dict], dict[str, list[dict]]]:
    """``args.lifetimes`` times: start A, then B beside it (each until ``/readyz`` answers 200),
    run ``args.rounds`` paired rounds of every workload at every level (:func:`paired_rounds`),
    then stop both (SIGTERM, waited: :func:`~service.bench.servers.serving`), also on an error.

    Returns (every server's record, :func:`_server_record` with round None, two per lifetime;
    {workload: one :func:`paired_summary` row per level, over the rounds of all lifetimes}).
    Raises SystemExit when a server does not get ready; for B, saying when its log points to
    memory (the two do not fit together)."""
    rng = random.Random(args.seed)
    servers: list[dict] = []
    rounds: dict[tuple[str, int], PairedRounds] = {}
    for _ in range(args.lifetimes):
        with ExitStack() as stack:
            up: dict[str, dict] = {}
            for key in ("a", "b"):
                up[key] = _start_beside(stack, sides[key], args, up.get("a"))
            servers += up.values()
            urls = {key: s["url"] for key, s in up.items()}
            for name, make in workloads(args).items():
                loads = {key: make() for key in sides}  # one per side: the same requests in the same order
                for level in args.concurrency:
                    into = rounds.setdefault((name, level), PairedRounds())
                    paired_rounds(urls, loads, level, args, rng, into)
                    print(progress_line(name, level, into, args.lifetimes), file=sys.stderr, flush=True)
    paired = {
        name: [paired_summary(rounds[(name, level)], level, args.target) for level in args.concurrency]
        for name in workloads(args)
    }
    return servers, paired


def progress_line(name: str, level: int, rounds: PairedRounds, lifetimes: int) -> str:
    """One line for stderr once a workload's rounds at one level end in a lifetime: each of
    that lifetime's rounds' B / A aggregate tok/s with its order, and their geometric mean,
    so that a run cut short (a ``timeout``, a lease's end) keeps what it measured."""
    life = rounds.lifetimes[-1]
    picked, stats = lifetime_statistics(rounds, life)
    each = " ".join(f"{fmt(r)}({rounds.orders[i]})" for r, i in zip(stats["ratio_by_round"], picked, strict=True))
    return (
        f"settings-ab: {name}, {level} stream(s), lifetime {life + 1} of {lifetimes}: B/A tok/s by round "
        f"{each}; geomean {fmt(stats['paired_ratio_geomean'])}"
    )


def lifetime_statistics(rounds: PairedRounds, life: int) -> tuple[list[int], dict]:
    """(the indices of lifetime ``life``'s rounds in ``rounds``, :func:`paired_statistics` of
    their aggregate tok/s alone)."""
    picked = [i for i, x in enumerate(rounds.lifetimes) if x == life]
    tok_s = {key: [rounds.by_round[key][i]["aggregate_tok_s"] for i in picked] for key in ("a", "b")}
    return picked, paired_statistics(tok_s["a"], tok_s["b"])


def _start_beside(stack: ExitStack, side: Side, args: argparse.Namespace, other: dict | None) -> dict:
    """Start ``side``'s server in ``stack`` (stopped when it closes) and return its record;
    ``other``: the server already up, if any (named when this one fails to start)."""
    log = args.log_dir / f"together-{side.key}-{side.name}.log"
    command = side.serve_command(args.serve_args)
    start = time.perf_counter()
    try:
        url, pid = stack.enter_context(serving(side.name, command, "/readyz", log, args.ready_timeout_s, side.env()))
    except SystemExit as error:
        if other is None:
            raise
        why = str(error.code)
        if OUT_OF_MEMORY.search(why):
            why = (
                f"{side.key.upper()} ({side.name}) ran out of memory while starting beside {other['name']} "
                f"(pid {other['pid']}): the two servers do not fit the device together; run without --together "
                f"(one server at a time).\n{why}"
            )
        else:
            why = f"{side.key.upper()} ({side.name}) did not start beside {other['name']} (pid {other['pid']}).\n{why}"
        raise SystemExit(why) from None
    return _server_record(side, None, command, url, pid, time.perf_counter() - start, log)


@dataclass
class PairedRounds:
    """One workload at one level, both sides' rounds so far (over every lifetime): the timed
    streams (by side key, by level), each round's figures per side, its order ("ab" or "ba")
    and the lifetime it ran in."""

    records: dict[str, dict[int, list[Stream]]] = field(default_factory=lambda: {"a": {}, "b": {}})
    by_round: dict[str, list[dict]] = field(default_factory=lambda: {"a": [], "b": []})
    orders: list[str] = field(default_factory=list)
    lifetimes: list[int] = field(default_factory=list)


def paired_rounds(
    urls: dict[str, str],
    loads: dict[str, Workload],
    level: int,
    args: argparse.Namespace,
    rng: random.Random,
    into: PairedRounds,
) -> None:
    """One workload at one level on both servers of one lifetime (``urls``, ``loads``: by side
    key): each side's untimed warm-up (``args.warmup_requests`` per stream), then
    ``args.rounds`` rounds, each a burst of ``level`` streams of ``args.requests`` requests
    (:func:`service.bench.load.run`) to A and to B, one server at a time: rounds 0, 2, ... in
    an order ``rng`` draws, each following round in the other order; appended to ``into``."""
    for key, url in urls.items():
        if args.warmup_requests:
            run(url, [level], args.warmup_requests, loads[key])
    lifetime = max(into.lifetimes, default=-1) + 1
    order = ["a", "b"]
    for i in range(args.rounds):
        if i % 2 == 0:
            rng.shuffle(order)
        else:
            order.reverse()
        into.orders.append("".join(order))
        into.lifetimes.append(lifetime)
        for key in order:
            (figures,) = run(urls[key], [level], args.requests, loads[key], 0, into.records[key])["levels"]
            into.by_round[key].append(figures)


def paired_summary(rounds: PairedRounds, level: int, target: float | None) -> dict:
    """The level's row: :func:`paired_statistics` of aggregate tok/s (all completion tokens of
    a burst over its wall time: at one stream and one request, that request's tok/s) over all
    rounds, the geometric mean of each lifetime's rounds alone (``paired_ratio_by_lifetime``:
    how far one pair of server lifetimes strays), each round's order, lifetime and figures per
    side, each side's figures pooled over rounds (:func:`~service.bench.common.level_figures`),
    and whether the overall geometric mean meets ``target`` (None without one)."""
    pooled = {
        key: level_figures(
            rounds.records[key].get(level, []), sum(f["errors"] for f in figs), sum(f["elapsed_s"] for f in figs)
        )
        for key, figs in rounds.by_round.items()
    }
    tok_s = {key: [f["aggregate_tok_s"] for f in rounds.by_round[key]] for key in ("a", "b")}
    stats = paired_statistics(tok_s["a"], tok_s["b"])
    by_lifetime = [
        lifetime_statistics(rounds, life)[1]["paired_ratio_geomean"] for life in sorted(set(rounds.lifetimes))
    ]
    geomean = stats["paired_ratio_geomean"]
    met = None if target is None or geomean is None else geomean >= target
    return {
        "concurrency": level,
        **stats,
        "paired_ratio_by_lifetime": by_lifetime,
        "order_by_round": rounds.orders,
        "lifetime_by_round": rounds.lifetimes,
        "a_by_round": rounds.by_round["a"],
        "b_by_round": rounds.by_round["b"],
        **pooled,
        "target_met": met,
    }


def _paired_table(name: str, rows: list[dict], a: Side, b: Side, title: str) -> Table:
    table = Table(title=f"{title}: {name} (both up, paired rounds; B = {b.name}, A = {a.name})")
    columns = ("streams", "rounds", "tok/s median A/B", "B/A geomean", "B/A min-max", "B/A by lifetime")
    columns += ("B/A by round (order)",)
    for col in (*columns, "TTFT p50 ms A/B", "ITL p50 ms A/B", "tokens A/B", "errors A/B", "target met"):
        table.add_column(col, justify="right")
    for r in rows:
        fa, fb = r["a"], r["b"]
        by_round = zip(r["ratio_by_round"], r["order_by_round"], strict=True)
        table.add_row(
            str(r["concurrency"]),
            str(r["rounds"]),
            f"{fmt(r['a_tok_s_median'], digits=1)}/{fmt(r['b_tok_s_median'], digits=1)}",
            fmt(r["paired_ratio_geomean"]),
            f"{fmt(r['paired_ratio_min'])}-{fmt(r['paired_ratio_max'])}",
            " ".join(fmt(q) for q in r["paired_ratio_by_lifetime"]),
            " ".join(f"{fmt(q)}({order})" for q, order in by_round),
            f"{fmt(fa['ttft_s_p50'], 1e3, 1)}/{fmt(fb['ttft_s_p50'], 1e3, 1)}",
            f"{fmt(fa['itl_s_p50'], 1e3, 2)}/{fmt(fb['itl_s_p50'], 1e3, 2)}",
            f"{fa['completion_tokens']}/{fb['completion_tokens']}",
            f"{fa['errors']}/{fb['errors']}",
            {True: "yes", False: "no", None: "-"}[r["target_met"]],
        )
    return table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepserve bench settings-ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a named A/B (see above)")
    for key in ("a", "b"):
        parser.add_argument(
            f"--{key}", metavar="NAME=FLAGS", help=f"side {key.upper()}: its name and extra serve flags (quoted)"
        )
        parser.add_argument(f"--{key}-dir", type=Path, metavar="DIR", help=f"run {key.upper()} from source tree DIR")
        parser.add_argument(f"--{key}-cmd", metavar="CMD", help=f"the command that runs stepserve for {key.upper()}")
    parser.add_argument("--stepserve", metavar="CMD", help="the command that runs stepserve for both sides")
    parser.add_argument(
        "--serve-args", type=shlex.split, default="", metavar="ARGS", help="serve flags for both, e.g. --serve-args=..."
    )
    parser.add_argument("--workload", nargs="+", choices=["chat", "long"], default=["chat", "long"])
    parser.add_argument("--concurrency", type=int, nargs="+", metavar="N", help="client streams per level (default: 1)")
    parser.add_argument(
        "--together",
        action="store_true",
        help="both servers up at once (the device must hold both), paired rounds: one burst to each per round",
    )
    parser.add_argument(
        "--rounds", type=int, help="rounds, each serving A and B once (default 2; with --together, paired rounds: 12)"
    )
    parser.add_argument(
        "--requests", type=int, help="timed requests per stream, level and round (default 3; with --together 1)"
    )
    parser.add_argument(
        "--lifetimes",
        type=int,
        default=1,
        help="--together: start both servers this many times, --rounds paired rounds each (default 1)",
    )
    parser.add_argument("--seed", type=int, default=0, help="--together: the seed of each round's A/B order")
    parser.add_argument("--warmup-requests", type=int, default=1, help="untimed requests per stream before each level")
    parser.add_argument("--system-tokens", type=int, default=450, help="chat: the shared system prompt's tokens, about")
    parser.add_argument("--chat-max-tokens", type=int, default=128)
    parser.add_argument("--long-max-tokens", type=int, default=512)
    parser.add_argument("--target", type=float, help="B / A aggregate tok/s to meet at every level")
    parser.add_argument("--ready-timeout-s", type=float, default=START_TIMEOUT_S, help="per server start")
    parser.add_argument("--log-dir", type=Path, help="the servers' logs (default: a new temporary directory)")
    parser.add_argument("--out", type=Path, help="write the JSON result here too")
    return parser


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Preset | None, dict[str, Side]]:
    """The preset and the two sides of parsed ``args``; fills in the defaults that depend on
    the preset and the mode (concurrency, target, rounds, requests, log directory). Exits
    through ``parser.error`` on missing or clashing sides."""
    preset = PRESETS[args.preset] if args.preset else None
    specs = {"a": args.a or (preset.a if preset else ""), "b": args.b or (preset.b if preset else "")}
    if not specs["a"] or not specs["b"]:
        parser.error("give --a and --b (NAME=FLAGS), or --preset")
    sides = {
        key: make_side(key, spec, getattr(args, f"{key}_cmd") or args.stepserve, getattr(args, f"{key}_dir"))
        for key, spec in specs.items()
    }
    if sides["a"].name == sides["b"].name:
        parser.error(f"A and B are both named '{sides['a'].name}'")
    args.concurrency = list(dict.fromkeys(args.concurrency or (preset.concurrency if preset else (1,))))
    args.target = args.target if args.target is not None else (preset.target if preset else None)
    if args.lifetimes < 1 or (args.lifetimes > 1 and not args.together):
        parser.error("--lifetimes takes a positive count, and more than 1 only with --together")
    args.rounds = args.rounds or (12 if args.together else 2)
    args.requests = args.requests or (1 if args.together else 3)
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="stepserve-settings-ab-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return preset, sides


def main(argv: list[str]) -> int:
    """``stepserve bench settings-ab [options]`` (``argv``: the options): serve A and B in
    alternating order for every round (with ``--together``: both at once, paired rounds),
    measure, print the tables to stderr and the JSON to stdout (and ``--out``). Returns 0.
    Raises SystemExit on bad arguments or a server that does not get ready."""
    parser = _parser()
    args = parser.parse_args(argv)
    preset, sides = _resolve(parser, args)
    title = f"{preset.label if preset else ''}{sides['b'].name}/{sides['a'].name}"
    if args.together:
        servers, paired = measure_together(sides, args)
        figures = {"paired": paired}
        tables = [_paired_table(name, rows, sides["a"], sides["b"], title) for name, rows in paired.items()]
    else:
        records: Records = {key: {name: {} for name in args.workload} for key in sides}
        servers = [measure(sides[key], round_, args, records) for round_, key in schedule(args.rounds)]
        figures = {"pooled": pool(servers, records, args.target)}
        tables = [
            _workload_table(name, rows, sides["a"], sides["b"], title) for name, rows in figures["pooled"].items()
        ]
    described = {key: side.describe(args.serve_args) for key, side in sides.items()}
    result = {
        "title": title,
        "preset": args.preset,
        "mode": "together" if args.together else "sequential",
        **described,
        "serve_args": shlex.join(args.serve_args),
        "workloads": {name: make().describe() for name, make in workloads(args).items()},
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "requests_per_stream": args.requests,
        "warmup_requests_per_stream": args.warmup_requests,
        "lifetimes": args.lifetimes if args.together else None,
        "seed": args.seed if args.together else None,
        "target": args.target,
        **figures,
        "servers": servers,
        "log_dir": str(args.log_dir),
    }
    return report(result, ["settings-ab", *argv], [*tables, _server_table(servers, described)], args.out)
