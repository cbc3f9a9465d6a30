"""`stepserve bench settings-ab --preset prefix` end to end on the default model (CPU): it starts
a server per configuration itself, one after the other, measures both with the same load and
reports B / A from the figures; every server it started has exited when it returns."""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest

from tests.support import STEPSERVE

FIGURES = ("aggregate_tok_s", "per_stream_tok_s_p50", "ttft_s_p50", "itl_s_p50")
LONG_TOKENS = 8


@pytest.fixture(scope="module")
def prefix_ab(tmp_path_factory):
    """The JSON of one round of the prefix preset, tiny: 1 stream, 1 request, a few tokens."""
    tmp = tmp_path_factory.mktemp("settings-ab")
    serve = "--warmup-prompt-tokens 64 --warmup-batch 1 --warmup-rehearsal false"
    done = subprocess.run(
        [STEPSERVE, "bench", "settings-ab", "--preset", "prefix", "--rounds", "1", "--requests", "1"]
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


def test_every_server_reported_its_warm_up_and_has_exited(prefix_ab):
    for server in prefix_ab["servers"]:
        assert 0 < server["warmup_s"] <= server["ready_s"]
        assert os.path.getsize(server["log"]) > 0
        with pytest.raises(ProcessLookupError):
            os.kill(server["pid"], 0)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server['url']}/healthz", timeout=5)
