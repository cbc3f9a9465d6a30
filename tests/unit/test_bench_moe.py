"""``stepserve bench moe``: its interleaved rounds and their summary."""

import json

import pytest

from service.bench import moe


def test_summary_is_the_ratio_of_medians_with_the_per_round_spread():
    rounds = [
        {"stepserve": {"pipelined_step_s": s}, "mlx_lm": {"pipelined_step_s": m}}
        for s, m in [(1.0, 2.0), (2.0, 2.0), (4.0, 2.0)]
    ]
    summary = moe.summarize(rounds)
    assert summary["stepserve"] == {"pipelined_step_s": 2.0}
    assert summary["mlx_lm"] == {"pipelined_step_s": 2.0}
    assert summary["mlx_lm_over_stepserve"] == 1.0
    assert (summary["ratio_min"], summary["ratio_max"]) == (0.5, 2.0)
    assert [r["mlx_lm_over_stepserve"] for r in summary["rounds"]] == [2.0, 1.0, 0.5]


def test_tiny_run_writes_every_round(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(moe, "machine_info", lambda in_process: {})  # platform.processor() runs uname
    out = tmp_path / "moe.json"
    argv = "--layers 1 --experts 4 --top-k 2 --hidden 64 --expert-width 64 --vocab 64 --batch 1 --capacity 32"
    argv += f" --steps 2 --repeats 1 --rounds 2 --dtype float32 --out {out}"
    assert moe.main(argv.split()) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["rounds"] == 2 and len(row["rounds"]) == 2
    assert row["ratio_min"] <= row["mlx_lm_over_stepserve"] <= row["ratio_max"]
    assert set(row["stepserve"]) >= {"pipelined_step_s", "sync_step_s", "dispatch_s", "eval_s"}
    printed = capsys.readouterr()
    assert json.loads(printed.out) == row
    assert "batch 1 round 2/2: stepserve" in printed.err


def test_rounds_below_one_are_refused():
    with pytest.raises(SystemExit):
        moe.main(["--rounds", "0"])
