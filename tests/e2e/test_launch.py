"""`stepserve launch` tells rank 0 when another rank of its group fails (real processes: a
stand-in rank 0 that waits for SIGUSR1, and a stand-in mlx.launch that reports the failure
on stderr as mlx.launch does)."""

from __future__ import annotations

import signal
import subprocess
import sys

from service.process import launch


def test_another_ranks_failure_is_told_to_rank_0_with_its_reason(tmp_path):
    """When mlx.launch reports rank 1 gone, rank 0 (the pid in the pid file) gets SIGUSR1 and
    reads why from the failure file; a failure of rank 0 itself is told to nobody."""
    waiting = "import signal, sys, time\n"
    waiting += "signal.signal(signal.SIGUSR1, lambda *a: (print(open(sys.argv[1]).read(), end=''), sys.exit(0)))\n"
    waiting += "print('ready', flush=True)\ntime.sleep(30)\n"
    pid_file = tmp_path / "rank0.pid"
    for failed, told in ((1, "rank 1 exited with code -9\n"), (0, "")):
        rank0 = subprocess.Popen(
            [sys.executable, "-c", waiting, str(launch.failure_file(pid_file))], stdout=subprocess.PIPE, text=True
        )
        assert rank0.stdout is not None and rank0.stdout.readline() == "ready\n"
        pid_file.write_text(f"{rank0.pid}\n")
        report = f"import sys; sys.stderr.write('[WARN] Node with rank {failed} exited with code -9\\n')"
        group = launch.Group([sys.executable, "-c", report], pid_file, kill_after_s=30)
        group.wait(grace_s=30)
        if told:
            assert rank0.wait(10) == 0 and rank0.stdout.read() == told
        else:
            assert rank0.poll() is None  # not signalled
            rank0.send_signal(signal.SIGKILL)
            rank0.wait()
        assert group.failures == [(failed, -9)]
