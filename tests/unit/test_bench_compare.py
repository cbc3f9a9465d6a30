"""``stepserve bench --side-by-side``'s server commands (:mod:`service.bench.compare`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.bench import compare
from service.bench.compare import _parser, servers


def test_serve_args_reach_stepserve_last_and_no_peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(compare, "openblas_env", lambda: {})  # it asks ldconfig: no process here
    argv = ["--side-by-side", "--concurrency", "1", "8", "--out-dir", str(tmp_path)]
    args = _parser().parse_args([*argv, "--serve-args=--warmup-batch 2 --kv-cache paged"])
    ours, peer = servers(tmp_path / "model", args)
    assert ours.name == "stepserve" and peer.name == "mlx_lm.server"
    assert ours.command[-4:] == ["--warmup-batch", "2", "--kv-cache", "paged"]
    assert ours.command.index("--warmup-batch") < len(ours.command) - 4  # the tool's own, overridden
    assert "--kv-cache" not in peer.command
    plain = servers(tmp_path / "model", _parser().parse_args(argv))[0]
    assert plain.command == ours.command[:-4]
