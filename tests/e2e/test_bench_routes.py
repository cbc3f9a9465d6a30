"""`stepserve bench routes` end to end against the session's real server of the default model
(CPU), tiny: 4 streams (1 on /v1/messages with tools, 1 on /v1/responses, 2 on chat
completions) against 4 on chat completions, one round, a few tokens. Every route must produce
tokens counted from its own usage field, and the JSON must hold mixed / all-chat."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support import STEPSERVE

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def routes(server, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench-routes") / "routes.json"
    args = ["--url", server.url, "--streams", "4", "--messages", "1", "--responses", "1", "--rounds", "1"]
    args += ["--requests", "1", "--warmup-requests", "0", "--max-tokens", str(MAX_TOKENS), "--system-tokens", "30"]
    done = subprocess.run(
        [STEPSERVE, "bench", "routes", *args, "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]  # 1: a request failed or lacked its usage
    result = json.loads(done.stdout)
    assert json.loads(out.read_text()) == result
    assert result["command"].startswith("stepserve bench routes --url ")
    return result


def test_every_route_of_the_mixed_load_produced_tokens_from_its_own_usage(routes):
    mixed = routes["pooled"]["mixed"]["routes"]
    assert routes["mixed_routes"] == {"messages": 1, "responses": 1, "chat": 2}
    assert {route: f["requests"] for route, f in mixed.items()} == {"chat": 2, "messages": 1, "responses": 1}
    for f in mixed.values():
        assert f["errors"] == 0 and f["error_reasons"] == {}
        assert 0 < f["completion_tokens"] <= f["requests"] * MAX_TOKENS
        assert f["ttft_s_p50"] is not None and f["prompt_tokens_p50"] > 0
    # The tools went into the Messages prompt: longer than the same conversation on chat.
    assert mixed["messages"]["prompt_tokens_min"] > mixed["chat"]["prompt_tokens_max"]
    all_chat = routes["pooled"]["all-chat"]
    assert list(all_chat["routes"]) == ["chat"] and all_chat["routes"]["chat"]["requests"] == 4
    assert all_chat["errors"] == 0 and all_chat["completion_tokens"] > 0
    assert routes["errors_total"] == 0 and routes["warmup_errors"] == 0


def test_the_json_has_mixed_over_all_chat(routes):
    (row,) = routes["by_round"]
    assert row["order"] == ["all-chat", "mixed"]
    ratio = routes["mixed_over_all_chat"]
    expected = row["mixed"]["aggregate_tok_s"] / row["all-chat"]["aggregate_tok_s"]
    assert ratio["rounds"] == 1 and ratio["ratio_geomean"] == pytest.approx(expected)
    assert routes["target_met"] == (ratio["ratio_geomean"] >= routes["target"])
    for name in ("all-chat", "mixed"):
        assert row[name]["compile_misses"] is not None  # a stepserve: its /metrics was read
