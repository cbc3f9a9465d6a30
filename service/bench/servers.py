"""Servers the bench tools start: a server subprocess on a free loopback port (and the BLAS it
loaded), the ports of an mlx.launch group's ring, and OpenBLAS for peer servers. No MLX import."""

from __future__ import annotations

import ctypes.util
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

STEPSERVE_SERVE = [sys.executable, "-m", "service.cli", "serve"]  # the CLI's main() loads OpenBLAS first
START_TIMEOUT_S = 900  # a cold CUDA host JIT-compiles its kernels for minutes (docs/BENCHMARKS.md)


def free_port() -> int:
    """A TCP port free on loopback right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int, low: int = 20000, high: int = 32000) -> int:
    """The first of ``count`` consecutive TCP ports free on loopback right now, for mlx.launch's
    ``--starting-port`` (the ring backend listens on it and the next ``count - 1``).

    Drawn at random from ``[low, high)``, below Linux's default ephemeral range (32768-60999,
    ``/proc/sys/net/ipv4/ip_local_port_range``): an OS-picked port's neighbour may be the local
    end of any outgoing connection, and the ring's bind then fails with EADDRINUSE. Raises
    RuntimeError when 200 draws found no free run."""
    for _ in range(200):
        first = random.SystemRandom().randrange(low, high - count + 1)  # whatever the global seed
        try:
            with ExitStack() as stack:
                for port in range(first, first + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports in [{low}, {high})")


@contextmanager
def serving(
    name: str,
    command: list[str],
    ready_path: str,
    log: Path,
    timeout_s: float = START_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, int]]:
    """Run ``command --port PORT`` (a free loopback port; environment ``env``, default this
    process's), output to ``log``, until the block ends; yields (base URL, process id) once
    ``GET ready_path`` answers 200. On leaving the block the process gets SIGTERM (a stepserve
    drains), and SIGKILL if it has not exited within 120 s; it has exited when the block ends.

    Raises:
        SystemExit: the process exited before it was ready, or was not ready within
            ``timeout_s`` seconds (with the tail of its log).
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen([*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while not _answers(f"{url}{ready_path}"):
            if proc.poll() is not None or time.monotonic() > deadline:
                state = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready in {timeout_s} s"
                raise SystemExit(f"{name} {state}; log {log}:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def openblas_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the OpenBLAS that
    ``ctypes.util.find_library("openblas")`` finds put first in ``LD_PRELOAD`` on Linux, so a
    peer server's MLX binds its CPU matmuls to it as stepserve's does (``models.blas``);
    unchanged elsewhere or when there is none."""
    env = dict(os.environ if base is None else base)
    lib = ctypes.util.find_library("openblas") if sys.platform == "linux" else None
    if lib:
        env["LD_PRELOAD"] = " ".join(filter(None, (lib, env.get("LD_PRELOAD"))))
    return env


def process_blas(pid: int) -> str:
    """The BLAS mapped into process ``pid`` (read once its MLX is loaded): "openblas" when a
    libopenblas is in ``/proc/PID/maps``, "reference" when not (MLX's bundled netlib BLAS),
    "accelerate" on macOS, "unknown" where the maps cannot be read."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        maps = Path(f"/proc/{pid}/maps").read_text(errors="replace")
    except OSError:
        return "unknown"
    return "openblas" if "libopenblas" in maps else "reference"
