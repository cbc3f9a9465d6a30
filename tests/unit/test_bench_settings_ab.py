"""`stepserve bench settings-ab` without servers: the order the servers run in, how rounds pool,
which source tree a side runs, and with --together (fake servers) that both are up before the
first round and stopped after the last, the shuffled order and the paired ratios (the whole
command end to end: tests/e2e)."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from rich.console import Console

from service.bench import settings_ab
from service.bench.common import Stream, level_figures
from service.bench.settings_ab import ROOT, STEPSERVE, make_side, paired_statistics, pool, schedule


def test_the_servers_alternate_which_goes_first():
    assert schedule(3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]


def stream(start: float, ttft: float, gap: float, tokens: int) -> Stream:
    arrivals = [start + ttft + i * gap for i in range(tokens)]
    return Stream(start=start, end=arrivals[-1], arrivals=arrivals)


def test_rounds_pool_their_requests_and_each_round_keeps_its_ratio():
    """Two rounds per side, of different speeds: the pooled figures are those of all four
    requests together (tokens over summed wall time), B / A is taken from them, and each
    round's B / A from that round's figures."""
    requests = {
        ("a", 0): [stream(0.0, 0.5, 0.10, 20)],
        ("a", 1): [stream(0.0, 0.4, 0.05, 20)],
        ("b", 0): [stream(0.0, 0.2, 0.08, 20)],
        ("b", 1): [stream(0.0, 0.3, 0.04, 20)],
    }
    servers = []
    for (side, round_), recs in requests.items():
        elapsed = recs[0].end - recs[0].start
        level = {"concurrency": 1, **level_figures(recs, 0, elapsed)}
        servers.append({"round": round_, "side": side, "results": {"long": {"levels": [level]}}})
    records = {side: {"long": {1: requests[(side, 0)] + requests[(side, 1)]}} for side in ("a", "b")}
    (row,) = pool(servers, records, target=1.0)["long"]
    for side in ("a", "b"):
        recs = records[side]["long"][1]
        walls = sum(r.end - r.start for r in recs)
        assert row[side]["aggregate_tok_s"] == pytest.approx(40 / walls)
        assert row[side]["requests"] == 2
    for key in ("aggregate_tok_s", "per_stream_tok_s_p50", "ttft_s_p50", "itl_s_p50"):
        assert row["b_over_a"][key] == pytest.approx(row["b"][key] / row["a"][key])
    by_level = {(s["side"], s["round"]): s["results"]["long"]["levels"][0] for s in servers}
    for round_, ratio in enumerate(row["b_over_a_by_round"]):
        a, b = by_level[("a", round_)], by_level[("b", round_)]
        assert ratio["aggregate_tok_s"] == pytest.approx(b["aggregate_tok_s"] / a["aggregate_tok_s"])
    assert row["target_met"] is (row["b_over_a"]["aggregate_tok_s"] >= 1.0)


def test_a_side_runs_the_source_tree_it_is_given(tmp_path: Path):
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "cli.py").write_text("")
    old = make_side("a", "old=--prefix-cache-bytes 0 --compile on", None, tmp_path)
    assert old.name == "old" and old.flags == ("--prefix-cache-bytes", "0", "--compile", "on")
    assert old.env()["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path.resolve())
    assert old.serve_command(["--model", "m"]) == [*STEPSERVE, "serve", "--model", "m", *old.flags]
    new = make_side("b", "new=", None, None)
    assert new.flags == () and new.env()["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    other = make_side("b", "other=", "/opt/venv/bin/stepserve", None)
    assert other.serve_command([]) == ["/opt/venv/bin/stepserve", "serve"] and other.source is None
    with pytest.raises(SystemExit, match="not a stepserve source tree"):
        make_side("a", "old=", None, tmp_path / "elsewhere")


def test_paired_statistics_are_those_of_the_rounds_ratios():
    """Round 3 has no A tokens: it is left out of the ratios but its B figure counts in B's
    median."""
    a, b = [10.0, 12.0, 8.0, None], [5.0, 6.0, 8.0, 7.0]
    stats = paired_statistics(a, b)
    assert stats["ratio_by_round"] == [pytest.approx(0.5), pytest.approx(0.5), pytest.approx(1.0), None]
    assert stats["rounds"] == 3
    assert stats["paired_ratio_geomean"] == pytest.approx((0.5 * 0.5 * 1.0) ** (1 / 3))
    assert (stats["paired_ratio_min"], stats["paired_ratio_max"]) == (pytest.approx(0.5), pytest.approx(1.0))
    assert (stats["a_tok_s_median"], stats["b_tok_s_median"]) == (10.0, 6.5)
    # The geometric mean is symmetric: A / B's is the inverse of B / A's.
    assert paired_statistics(b, a)["paired_ratio_geomean"] == pytest.approx(1 / stats["paired_ratio_geomean"])
    assert paired_statistics([None], [1.0])["paired_ratio_geomean"] is None
    with pytest.raises(ValueError):
        paired_statistics([1.0], [1.0, 2.0])


SPEEDS = {"off": [10.0, 12.0, 8.0, 9.0], "on": [5.0, 6.0, 8.0, 18.0]}  # each side's tok/s per stream, by round


class FakeServers:
    """``serving`` and ``load.run`` of settings_ab, faked: servers are names, each timed burst
    of round i streams at ``SPEEDS[name][i]`` tok/s; ``events`` is what happened, in order."""

    def __init__(self, fail: dict[str, str] | None = None):
        self.events: list[tuple] = []
        self.fail = fail or {}  # server name -> the SystemExit text its start raises
        self.timed: dict[tuple, int] = {}  # (server, workload, level) -> timed bursts so far

    @contextmanager
    def serving(self, name: str, command, ready_path, log, timeout_s, env) -> Iterator[tuple[str, int]]:
        self.events.append(("start", name))
        try:
            if name in self.fail:
                raise SystemExit(self.fail[name])
            yield f"http://{name}:1", 1000 + len(self.events)
        finally:
            self.events.append(("stop", name))

    def run(self, url, levels, requests_per_stream, workload, warmup_requests=0, records=None) -> dict:
        (level,) = levels
        name = url.split("//")[1].split(":")[0]
        if records is None:
            self.events.append(("warm-up", name, workload.name, level))
            return {"levels": []}
        key = (name, workload.name, level)
        round_ = self.timed[key] = self.timed.get(key, -1) + 1
        gap = 1 / SPEEDS[name][round_]
        recs = [stream(0.0, gap, gap, 10) for _ in range(level * requests_per_stream)]
        records.setdefault(level, []).extend(recs)
        self.events.append(("round", name, workload.name, level))
        return {"levels": [{"concurrency": level, **level_figures(recs, 0, 10 * requests_per_stream * gap)}]}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def record(side, round_, command, url, pid, ready_s, log):
            return {"round": round_, "side": side.key, "name": side.name, "url": url, "pid": pid}

        monkeypatch.setattr(settings_ab, "git_describe", lambda path: None)  # unit tests start no process
        monkeypatch.setattr(settings_ab, "serving", self.serving)
        monkeypatch.setattr(settings_ab, "run", self.run)
        monkeypatch.setattr(
            settings_ab, "_server_record", lambda *a: record(*a) | dict.fromkeys(["ready_s", "warmup_s", "blas"])
        )


def together(monkeypatch, tmp_path: Path, servers: FakeServers, *extra: str) -> tuple[list[dict], dict]:
    """settings-ab --together on ``servers``: (the server records, {workload: rows}), after
    checking that the table of each workload renders."""
    servers.install(monkeypatch)
    argv = ["--a", "off=--prefix-cache-bytes 0", "--b", "on=", "--together", "--rounds", "4"]
    argv += ["--workload", "chat", "long", "--concurrency", "1", "2", "--log-dir", str(tmp_path), *extra]
    parser = settings_ab._parser()
    args = parser.parse_args(argv)
    _, sides = settings_ab._resolve(parser, args)
    records, paired = settings_ab.measure_together(sides, args)
    for name, rows in paired.items():
        text = io.StringIO()
        Console(file=text, width=300).print(settings_ab._paired_table(name, rows, sides["a"], sides["b"], "t"))
        assert f"t: {name}" in text.getvalue()
    return records, paired


def test_together_starts_both_alternates_and_pairs_each_round(monkeypatch, tmp_path: Path):
    fake = FakeServers()
    servers, paired = together(monkeypatch, tmp_path, fake)
    events = fake.events
    assert events[:2] == [("start", "off"), ("start", "on")]  # both up before any request
    assert events[-2:] == [("stop", "on"), ("stop", "off")]  # and stopped only after the last
    assert [(s["round"], s["side"]) for s in servers] == [(None, "a"), (None, "b")]
    timed = [e for e in events if e[0] == "round"]
    orders = set()
    for name in ("chat", "long"):
        for row, level in zip(paired[name], (1, 2), strict=True):
            assert row["concurrency"] == level and row["rounds"] == 4
            bursts = [e[1] for e in timed if e[2:] == (row_workload(name), level)]
            # Each round is one burst to each server, in the order the row says it ran.
            pairs = ["".join("a" if n == "off" else "b" for n in bursts[i : i + 2]) for i in range(0, 8, 2)]
            assert pairs == row["order_by_round"]
            orders |= set(pairs)
            # Each side was warmed up at this level before its first timed burst.
            for side in ("off", "on"):
                assert events.index(("warm-up", side, row_workload(name), level)) < events.index(
                    ("round", side, row_workload(name), level)
                )
            expected = [b / a for a, b in zip(SPEEDS["off"], SPEEDS["on"], strict=True)]
            assert row["ratio_by_round"] == pytest.approx(expected)
            assert row["paired_ratio_geomean"] == pytest.approx(math.prod(expected) ** (1 / 4))
            assert (row["paired_ratio_min"], row["paired_ratio_max"]) == pytest.approx((min(expected), max(expected)))
            assert row["a_tok_s_median"] == pytest.approx(level * 9.5) and row["b_tok_s_median"] == pytest.approx(
                level * 7
            )
            assert row["a"]["requests"] == row["b"]["requests"] == 4 * level
    assert orders == {"ab", "ba"}  # the order was shuffled, not fixed


def test_together_lifetimes_restart_both_and_pool_every_round(monkeypatch, tmp_path: Path):
    """--lifetimes 2 --rounds 2: both servers start, serve two paired rounds per level, stop, and
    start afresh for two more; the row pools all four rounds and gives each lifetime's own."""
    fake = FakeServers()
    servers, paired = together(monkeypatch, tmp_path, fake, "--lifetimes", "2", "--rounds", "2")
    starts = [i for i, e in enumerate(fake.events) if e[0] == "start"]
    stops = [i for i, e in enumerate(fake.events) if e[0] == "stop"]
    assert len(starts) == len(stops) == 4 and stops[1] < starts[2]  # the first pair is gone before the second
    assert [s["side"] for s in servers] == ["a", "b", "a", "b"]
    expected = [b / a for a, b in zip(SPEEDS["off"], SPEEDS["on"], strict=True)]
    for rows in paired.values():
        for row in rows:
            assert row["rounds"] == 4 and row["lifetime_by_round"] == [0, 0, 1, 1]
            assert row["ratio_by_round"] == pytest.approx(expected)
            assert row["paired_ratio_geomean"] == pytest.approx(math.prod(expected) ** (1 / 4))
            assert row["paired_ratio_by_lifetime"] == pytest.approx(
                [math.sqrt(expected[0] * expected[1]), math.sqrt(expected[2] * expected[3])]
            )


def test_together_reports_each_level_as_its_rounds_end(monkeypatch, tmp_path: Path, capsys):
    """A run cut short keeps what it measured: each (workload, level, lifetime) prints its
    rounds' B / A and their geometric mean to stderr as soon as its rounds end, in run order."""
    fake = FakeServers()
    _, paired = together(monkeypatch, tmp_path, fake, "--lifetimes", "2", "--rounds", "2")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("settings-ab:")]
    assert [line.split(":")[1].strip() for line in lines] == [
        f"{name}, {level} stream(s), lifetime {life} of 2"
        for life in (1, 2)
        for name in ("chat", "long")
        for level in (1, 2)
    ]
    expected = [b / a for a, b in zip(SPEEDS["off"], SPEEDS["on"], strict=True)]
    row = paired["chat"][0]
    assert lines[0].endswith(
        f"by round {expected[0]:.3f}({row['order_by_round'][0]}) {expected[1]:.3f}({row['order_by_round'][1]}); "
        f"geomean {math.sqrt(expected[0] * expected[1]):.3f}"
    )
    assert lines[4].endswith(f"geomean {math.sqrt(expected[2] * expected[3]):.3f}")  # lifetime 2: its own rounds


def test_lifetimes_need_together(tmp_path: Path):
    parser = settings_ab._parser()
    args = parser.parse_args(["--a", "x=", "--b", "y=", "--lifetimes", "2", "--log-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        settings_ab._resolve(parser, args)


def row_workload(name: str) -> str:
    return {"chat": "chat-shared-prefix", "long": "long"}[name]


def test_together_orders_come_from_the_seed(monkeypatch, tmp_path: Path):
    def orders(*extra: str) -> list[list[str]]:
        _, paired = together(monkeypatch, tmp_path, FakeServers(), *extra)
        return [row["order_by_round"] for rows in paired.values() for row in rows]

    assert orders("--seed", "3") == orders("--seed", "3")


@pytest.mark.parametrize("seed", range(6))
def test_together_each_pair_of_rounds_puts_each_side_first_once(monkeypatch, tmp_path: Path, seed):
    """A side that goes first (or second) may gain or pay for it: over each pair of rounds each
    side goes first once, the pair's first order still drawn from the seed."""
    _, paired = together(monkeypatch, tmp_path, FakeServers(), "--seed", str(seed))
    firsts = set()
    for rows in paired.values():
        for row in rows:
            orders = row["order_by_round"]
            assert len(orders) == 4
            for first, second in (orders[0:2], orders[2:4]):
                assert {first, second} == {"ab", "ba"}
            firsts.add(orders[0])
    assert firsts == {"ab", "ba"}  # the pairs' first orders are drawn, not fixed


@pytest.mark.parametrize(
    ("log", "says"),
    [
        ("on exited with 1; log x:\n[malloc] Unable to allocate 4294967296 bytes.", "run without --together"),
        ("on exited with -9; log x:\n", "run without --together"),
        ("on exited with 2; log x:\nerror: unknown flag", "did not start beside off"),
    ],
)
def test_together_b_that_fails_to_start_says_why_and_a_is_stopped(monkeypatch, tmp_path: Path, log, says):
    fake = FakeServers(fail={"on": log})
    with pytest.raises(SystemExit) as exited:
        together(monkeypatch, tmp_path, fake)
    message = str(exited.value.code)
    assert says in message and log in message
    assert ("without --together" in message) is (says == "run without --together")
    assert fake.events == [("start", "off"), ("start", "on"), ("stop", "on"), ("stop", "off")]
