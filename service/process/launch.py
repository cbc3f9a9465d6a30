"""``stepserve launch``: start a pipeline group with ``mlx.launch`` and exit as the group did.

    stepserve launch [--kill-after S] [MLX.LAUNCH OPTIONS] [-- SERVE OPTIONS]

runs ``mlx.launch MLX.LAUNCH OPTIONS -- stepserve serve --distributed SERVE OPTIONS`` (each
rank's ``stepserve`` is this one's path, so every host needs the same install path), with
every ``STEPSERVE_*`` and ``TMPDIR`` variable of this process passed to every rank (a remote
rank starts in a fresh ssh shell), and mlx.launch's output passed through. It runs mlx.launch's
own code without its busy loop (:data:`MLX_LAUNCH`). Why a wrapper:

* **the exit status**: mlx.launch stops the other ranks when one exits non-zero, but exits 0
  itself (MLX 0.32.4; it prints ``Node with rank R exited with code C``), so launchd would
  not count a failed group as a crash. This exits with the first failed rank's code (1 when
  it was killed by a signal), 0 when every rank exited 0;
* **a hung rank**: mlx.launch terminates the other ranks with SIGTERM and waits for each, so a
  stopped process (SIGSTOP) keeps it waiting forever. ``--kill-after S`` (default 30) seconds
  after a failure, mlx.launch's process group (it and the ranks it started on this host; a
  remote rank's ssh session ends with it) is killed;
* **a lost rank**: when another rank exits, rank 0 is told at once (SIGUSR1, the reason in
  :func:`failure_file`), so it ends its requests with an error naming that rank rather than
  waiting in a collective that may never return (:meth:`EngineWatchdog.peer_lost`);
* **SIGTERM** (launchd's stop): forwarded to rank 0 alone (its pid file), which drains its
  requests and then stops the other ranks: the group exits 0 together. Before rank 0 has
  started, or ``--kill-after`` seconds after a second SIGTERM, the group is killed.

Run it on the host of rank 0 (the first host of the hostfile): the pid file is local.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BIN = Path(sys.executable).parent
FAILED = re.compile(rb"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
FORWARDED_ENV = ("TMPDIR",)  # and every STEPSERVE_* variable
KILL_AFTER_S = 30.0  # --kill-after's default
STOP_GRACE_S = 70.0  # --stop-grace's default: above rank 0's drain (shutdown_grace_s 30 s + 10 s + 10 s)


# mlx.launch's own main(), with one change: the `select` of its output loop is given no file to
# write. It only ever writes to a rank's stdin what it read from its own, and `stepserve launch`
# gives it a stdin that is never readable; but it polls each rank's stdin pipe, always writable,
# for writing, so each of its threads spins (1.3 cores with two ranks, idle, measured here).
MLX_LAUNCH = """
import select, sys
from mlx._distributed_utils import launch
sys.argv[0] = "mlx.launch"
if getattr(launch, "select", None) is select.select:
    launch.select = lambda r, w, x, timeout=None: select.select(r, [], x, timeout)
sys.exit(launch.main())
"""


def command(launch_args: list[str], serve_args: list[str], pid_file: Path, env: dict[str, str]) -> list[str]:
    """The mlx.launch command line of a group (:data:`MLX_LAUNCH`): ``env``'s settings passed
    with ``--env``."""
    passed = [f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("STEPSERVE_") or k in FORWARDED_ENV]
    forwarded = [arg for kv in passed for arg in ("--env", kv)]
    serve = [str(BIN / "stepserve"), "serve", "--distributed", *serve_args, "--pid-file", str(pid_file)]
    return [sys.executable, "-c", MLX_LAUNCH, *launch_args, *forwarded, "--", *serve]


def failure_file(pid_file: Path) -> Path:
    """Where `stepserve launch` writes why another rank failed (e.g. "rank 1 exited with code
    -9") before it sends rank 0 SIGUSR1: beside rank 0's pid file."""
    return pid_file.with_name(pid_file.name + ".failed")


class Group:
    """One mlx.launch run: its output passed through and read for failed ranks."""

    def __init__(self, argv: list[str], pid_file: Path, kill_after_s: float):
        self.pid_file, self.kill_after_s = pid_file, kill_after_s
        self.failures: list[tuple[int, int | None]] = []  # (rank, exit code; None: killed)
        self.failed_at: float | None = None
        self.stopping_at: float | None = None
        self._stdin_r, self._stdin_w = os.pipe()  # never readable: with /dev/null mlx.launch's loop spins
        # A process group of its own: mlx.launch and this host's ranks, killed together if need be.
        self.process = subprocess.Popen(argv, stdin=self._stdin_r, stderr=subprocess.PIPE, process_group=0)
        os.close(self._stdin_r)
        self._reader = threading.Thread(target=self._read, name="stepserve-launch-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            match = FAILED.search(line)
            if match:
                self.failures.append((int(match[1]), int(match[2]) if match[2] is not None else None))
                self.failed_at = self.failed_at or time.monotonic()
                if len(self.failures) == 1 and self.failures[0][0] != 0:
                    self._tell_rank0(*self.failures[0])

    def _tell_rank0(self, rank: int, code: int | None) -> None:
        """Rank ``rank`` failed: tell rank 0 why (:func:`failure_file`) and send it SIGUSR1. MLX's
        ring backend (0.32.4) fails the collectives pending when a peer's socket closes, but one
        started just after waits forever, so rank 0 may never see the failure by itself."""
        how = f"exited with code {code}" if code is not None else "was killed"
        try:
            pid = int(self.pid_file.read_text())
            failure_file(self.pid_file).write_text(f"rank {rank} {how}\n")
            os.kill(pid, signal.SIGUSR1)
        except (OSError, ValueError):  # rank 0 not started yet, or gone: nothing to tell
            pass

    def stop(self, signum: int, _frame=None) -> None:
        """SIGTERM/SIGINT: rank 0 drains and stops the group; a second one, or no rank 0 yet, kills it."""
        try:
            pid = int(self.pid_file.read_text())
        except (OSError, ValueError):
            pid = None
        if pid is None or self.stopping_at is not None:
            self.kill(f"signal {signum}")
            return
        self.stopping_at = time.monotonic()
        print(f"stepserve launch: signal {signum}: stopping rank 0 (pid {pid}), which stops the group", file=sys.stderr)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            self.kill("rank 0 is gone")

    def kill(self, why: str) -> None:
        """Kill mlx.launch's process group (mlx.launch and the ranks on this host)."""
        print(f"stepserve launch: {why}: killing the group", file=sys.stderr, flush=True)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, grace_s: float) -> int:
        """Wait for mlx.launch; kill the group ``kill_after_s`` after a failure, or ``grace_s``
        after a SIGTERM. Returns this command's exit status."""
        killed = False
        while self.process.poll() is None:
            now = time.monotonic()
            if not killed and self.failed_at is not None and now - self.failed_at > self.kill_after_s:
                self.kill(f"rank {self.failures[0][0]} failed and the group did not exit in {self.kill_after_s:.0f} s")
                killed = True
            if not killed and self.stopping_at is not None and now - self.stopping_at > grace_s:
                self.kill(f"the group did not stop in {grace_s:.0f} s")
                killed = True
            time.sleep(0.1)
        self._reader.join(5)
        os.close(self._stdin_w)
        if not self.failures:
            return self.process.returncode
        rank, code = self.failures[0]
        how = f"exited with code {code}" if code is not None else "was killed"
        print(f"stepserve launch: the group stopped: rank {rank} {how}", file=sys.stderr, flush=True)
        return code if code is not None and code > 0 else 1


def main(argv: list[str]) -> int:
    """``stepserve launch ...``; returns the group's exit status (see the module doc)."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        prog="stepserve launch",
        usage="stepserve launch [--kill-after S] [MLX.LAUNCH OPTIONS] [-- SERVE OPTIONS]",
        description="Serve one model split over the ranks of an mlx.launch group: runs mlx.launch (any of its "
        "options) with 'stepserve serve --distributed' and the options after '--', passes STEPSERVE_* and TMPDIR "
        "to every rank, forwards SIGTERM to rank 0 (which stops the group) and exits with the first failed "
        "rank's code (mlx.launch itself exits 0). Run it on the first host of the hostfile.",
    )
    parser.add_argument(
        "--kill-after",
        type=float,
        default=KILL_AFTER_S,
        metavar="S",
        help="seconds after a rank failed before the group is killed (a stopped rank keeps mlx.launch waiting)",
    )
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=STOP_GRACE_S,
        metavar="S",
        help="seconds rank 0 gets to stop the group on SIGTERM",
    )
    own, launch_args = parser.parse_known_args(argv[:split])
    with tempfile.TemporaryDirectory(prefix="stepserve-launch-") as tmp:
        pid_file = Path(tmp) / "rank0.pid"
        group = Group(command(launch_args, argv[split + 1 :], pid_file, dict(os.environ)), pid_file, own.kill_after)
        signal.signal(signal.SIGTERM, group.stop)
        signal.signal(signal.SIGINT, group.stop)
        return group.wait(own.stop_grace)
