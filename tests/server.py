"""A real `stepserve serve` process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from service.bench.compare import free_port

STEPSERVE = str(Path(sys.executable).parent / "stepserve")
START_TIMEOUT_S = 600  # warm-up on a slow 2-core CI machine


@dataclass
class ServerProcess:
    """A running server; ``readyz_codes`` records /readyz answers seen while starting."""

    process: subprocess.Popen
    port: int
    log_path: Path
    readyz_codes: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, args: list[str], env: dict | None = None) -> ServerProcess:
        port = free_port()
        log = Path(tempfile.mkstemp(prefix="stepserve-", suffix=".log")[1])
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [STEPSERVE, "serve", "--port", str(port), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        return cls(proc, port, log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, timeout: float = 300) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        """Poll /readyz until 200; fail with the server log if it exits or times out."""
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"stepserve exited with {self.process.returncode}:\n{self.log()}")
                try:
                    code = client.get("/readyz").status_code
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                self.readyz_codes.append(code)
                if code == 200:
                    return
                time.sleep(0.05)
        raise TimeoutError(f"stepserve not ready after {START_TIMEOUT_S} s:\n{self.log()}")

    def metric(self, name: str, **labels) -> float:
        """Sum of a metric's samples whose labels include ``labels`` (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == str(v) for k, v in labels.items())
        )

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
