"""`stepserve bench settings-ab --preset prefix` end to end on the default model (CPU): it starts
a server per configuration itself, one after the other (with --together: both at once, then
paired rounds), measures both with the same load and reports B / A from the figures; every
server it started has exited when it returns."""

from __future__ import annotations

import json
import math
import os
import subprocess

import httpx
import pytest

from tests.support import STEPSERVE

FIGURES = ("aggregate_tok_s", "per_stream_tok_s_p50", "ttft_s_p50", "itl_s_p50")
LONG_TOKENS = 8


def settings_ab(tmp, *extra: str) -> dict:
    """The JSON of ``stepserve bench settings-ab --preset prefix`` tiny (1 request per stream, a
    few tokens) with ``extra`` options, checked against its ``--out`` file. Its servers warm up
    little (prompts up to 64 tokens, batch 1, capacities 256 and 512, no rehearsal): every request
    here fits 256 positions, and what is measured is the tool, not the server's speed."""
    serve = "--warmup-prompt-tokens 64 --warmup-batch 1 --warmup-rehearsal false --capacity-buckets 256,512"
    done = subprocess.run(
        [STEPSERVE, "bench", "settings-ab", "--preset", "prefix", "--requests", "1", *extra]
        + ["--chat-max-tokens", "4", "--long-max-tokens", str(LONG_TOKENS), "--system-tokens", "100"]
        + [f"--serve-args={serve}", "--out", str(tmp / "ab.json"), "--log-dir", str(tmp / "logs")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert json.loads((tmp / "ab.json").read_text()) == result
    return result


@pytest.fixture(scope="module")
def prefix_ab(tmp_path_factory):
    """One round of the prefix preset at 1 stream."""
    return settings_ab(tmp_path_factory.mktemp("settings-ab"), "--rounds", "1")


@pytest.fixture(scope="module")
def prefix_together(tmp_path_factory):
    """The prefix preset with both servers up: 3 paired rounds at 1 and 2 streams."""
    return settings_ab(
        tmp_path_factory.mktemp("settings-ab-together"), "--together", "--rounds", "3", "--concurrency", "1", "2"
    )


def test_both_configurations_were_served_with_their_own_flags(prefix_ab):
    a, b = prefix_ab["a"], prefix_ab["b"]
    assert (a["name"], b["name"]) == ("off", "on")
    assert "--prefix-cache-bytes 0" in a["command"] and "--prefix-cache-bytes" not in b["command"]
    servers = prefix_ab["servers"]
    assert [(s["round"], s["side"]) for s in servers] == [(0, "a"), (0, "b")]
    assert servers[0]["command"].startswith(a["command"]) and servers[1]["command"].startswith(b["command"])
    chat = prefix_ab["pooled"]["chat"][0]
    # The flags reached the servers: only B's prefix cache served the shared system prompt.
    assert chat["a"]["cached_tokens_total"] == 0 and chat["b"]["cached_tokens_total"] > 0


def test_each_workload_ran_on_both_and_the_ratios_are_b_over_a(prefix_ab):
    for name in ("chat", "long"):
        (row,) = prefix_ab["pooled"][name]
        assert row["concurrency"] == 1
        for side in ("a", "b"):
            assert row[side]["requests"] == 1 and row[side]["errors"] == 0
        for key in FIGURES:
            assert row["b_over_a"][key] == pytest.approx(row["b"][key] / row["a"][key])
        # One round: the pooled figures are that round's, and so is its ratio.
        server = {s["side"]: s for s in prefix_ab["servers"]}
        (level,) = server["a"]["results"][name]["levels"]
        assert row["a"]["aggregate_tok_s"] == pytest.approx(level["aggregate_tok_s"])
        assert row["b_over_a_by_round"] == [pytest.approx(row["b_over_a"])]
        assert row["target_met"] == (row["b_over_a"]["aggregate_tok_s"] >= prefix_ab["target"])
    long = prefix_ab["pooled"]["long"][0]
    assert long["a"]["completion_tokens"] == long["b"]["completion_tokens"] == LONG_TOKENS  # ignore_eos


@pytest.mark.parametrize("run", ["prefix_ab", "prefix_together"])
def test_every_server_reported_its_warm_up_and_has_exited(run, request):
    for server in request.getfixturevalue(run)["servers"]:
        assert 0 < server["warmup_s"] <= server["ready_s"]
        assert os.path.getsize(server["log"]) > 0
        with pytest.raises(ProcessLookupError):
            os.kill(server["pid"], 0)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server['url']}/healthz", timeout=5)


def test_together_served_both_at_once_with_their_own_flags(prefix_together):
    a, b = prefix_together["a"], prefix_together["b"]
    servers = prefix_together["servers"]
    assert prefix_together["mode"] == "together" and [(s["round"], s["side"]) for s in servers] == [
        (None, "a"),
        (None, "b"),
    ]
    assert servers[0]["command"].startswith(a["command"]) and servers[1]["command"].startswith(b["command"])
    assert servers[0]["url"] != servers[1]["url"]
    for row in prefix_together["paired"]["chat"]:  # only B's prefix cache served the shared system prompt
        assert row["a"]["cached_tokens_total"] == 0 and row["b"]["cached_tokens_total"] > 0


def test_together_paired_rounds_give_the_ratios(prefix_together):
    for name in ("chat", "long"):
        rows = prefix_together["paired"][name]
        assert [row["concurrency"] for row in rows] == [1, 2]
        for row in rows:
            level = row["concurrency"]
            assert len(row["order_by_round"]) == 3 and set(row["order_by_round"]) <= {"ab", "ba"}
            a = [r["aggregate_tok_s"] for r in row["a_by_round"]]
            b = [r["aggregate_tok_s"] for r in row["b_by_round"]]
            ratios = [y / x for x, y in zip(a, b, strict=True)]
            assert row["rounds"] == 3 and row["ratio_by_round"] == pytest.approx(ratios)
            assert row["paired_ratio_geomean"] == pytest.approx(math.prod(ratios) ** (1 / 3))
            assert (row["paired_ratio_min"], row["paired_ratio_max"]) == pytest.approx((min(ratios), max(ratios)))
            assert row["a_tok_s_median"] == pytest.approx(sorted(a)[1])
            assert row["b_tok_s_median"] == pytest.approx(sorted(b)[1])
            for side in ("a", "b"):  # one burst of `level` streams, one request each, per round
                assert row[side]["requests"] == 3 * level and row[side]["errors"] == 0
            if name == "long":  # ignore_eos
                assert row["a"]["completion_tokens"] == row["b"]["completion_tokens"] == 3 * level * LONG_TOKENS
