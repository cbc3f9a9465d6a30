"""`stepserve launch`'s command line, the mlx.launch code it patches, and how it reads
mlx.launch's report of a failed rank (mlx.launch's own message function, not a copy of its text)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from mlx._distributed_utils import common

from service.process import launch


def test_the_command_runs_every_rank_distributed_with_this_hosts_settings():
    env = {"STEPSERVE_CONFIG": "/opt/stepserve/stepserve.toml", "TMPDIR": "/opt/stepserve/tmp", "HOME": "/Users/x"}
    argv = launch.command(["--hostfile", "h.json"], ["--port", "8000"], Path("/tmp/r0.pid"), env)
    split = argv.index("--")
    assert argv[1:3] == ["-c", launch.MLX_LAUNCH] and argv[3:5] == ["--hostfile", "h.json"]
    forwarded = ["STEPSERVE_CONFIG=/opt/stepserve/stepserve.toml", "TMPDIR=/opt/stepserve/tmp"]  # not HOME
    assert argv[5:split] == ["--env", forwarded[0], "--env", forwarded[1]]
    assert argv[split + 1].endswith("/stepserve")
    assert argv[split + 2 :] == ["serve", "--distributed", "--port", "8000", "--pid-file", "/tmp/r0.pid"]


def test_mlx_launchs_select_is_the_one_patched():
    """The busy loop's fix replaces the `select` mlx.launch's module imported (MLX 0.32.4)."""
    import select

    from mlx._distributed_utils import launch as mlx_launch

    assert getattr(mlx_launch, "select") is select.select and callable(mlx_launch.main)  # noqa: B009


def test_a_failed_rank_is_read_from_mlx_launchs_own_warning():
    lines = []
    messages = ("Node with rank 1 exited with code 70", "Node with rank 0 was killed", "Node with rank 2 completed")
    for message in messages:
        out = io.StringIO()
        with contextlib.redirect_stderr(out):
            common.log_warning(message)
        lines.append(out.getvalue().encode())
    found = [launch.FAILED.search(line) for line in lines]
    assert [(m[1], m[2]) if m else None for m in found] == [(b"1", b"70"), (b"0", None), None]


def test_ring_ports_are_a_free_run_below_the_ephemeral_range():
    """A group's ring ports (mlx.launch's --starting-port and the next ones) are all bindable:
    a taken port is never in the run."""
    import socket

    from service.bench.servers import free_ports

    first = free_ports(4)
    assert 20000 <= first <= 32000 - 4
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first))
        for _ in range(20):  # runs of 3 in [first, first + 4): only the one after the taken port
            assert free_ports(3, low=first, high=first + 4) == first + 1
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", first))
        b.bind(("127.0.0.1", first + 1))
        with pytest.raises(RuntimeError, match="no 2 consecutive free ports"):
            free_ports(2, low=first, high=first + 2)  # the one run there is taken
