"""`stepserve bench settings-ab` without servers: the order the servers run in, how rounds pool,
and which source tree a side runs (the whole command end to end: tests/e2e)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.bench.common import Stream, level_figures
from service.bench.settings_ab import ROOT, STEPSERVE, make_side, pool, schedule


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
