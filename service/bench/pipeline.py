"""What splitting a model over processes costs per decode step: one process on the whole
model against N ranks (``mlx.launch``, ring backend over 127.0.0.1) on its pipeline stages
(:mod:`models.pipeline`), the same model, dtype and weights.

``stepserve bench pipeline --out FILE`` alternates rounds of the two (each a fresh
process group, so both see the same machine load), and writes JSON: per batch and compile
policy, the median milliseconds per decode step on rank 0 (the loop the engine will run: rank 0
broadcasts the step's tokens and positions, every rank runs its compiled stage step, rank 0 reads
the greedy tokens back), the broadcast alone, a hidden state's round trip between two ranks,
and each rank's MLX memory after loading its stage. Figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from models.blas import load_cpu_blas

if os.environ.get("STEPSERVE_BENCH_PIN") and hasattr(os, "sched_setaffinity"):
    # --pin: rank r on core r (one process on core 0), before MLX and OpenBLAS start threads,
    # which inherit it: each rank on a core of its own, as on hosts of their own.
    os.sched_setaffinity(0, {int(os.environ.get("MLX_RANK", "0")) % (os.cpu_count() or 1)})
load_cpu_blas()

import mlx.core as mx  # noqa: E402

from models import llama, pipeline  # noqa: E402
from models.default import default_model_path  # noqa: E402
from models.kv_cache import KVCache  # noqa: E402
from models.stage_loader import load_stage, model_layout  # noqa: E402
from service.bench.common import machine_info, quiet_compile_cache  # noqa: E402
from service.bench.servers import free_ports  # noqa: E402
from service.engine.compile_cache import StepKey, StepSpec  # noqa: E402
from service.process.launch import MLX_LAUNCH  # noqa: E402

CAPACITY, START = 256, 64  # decode at capacity 256 from position 64


def _median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def _decode_loop(loaded, group, batch: int, policy: str, steps: int) -> dict:
    """This rank's median wall ms per decode step (broadcast inputs on a group, the step, the
    greedy tokens read back on rank 0) and its CPU ms per step (user and system, all threads)."""
    args, stage = loaded.args, loaded.stage
    if group is None:
        fn = partial(llama.decode, args=args)
    else:
        fn = partial(pipeline.decode, args=args, stage=stage, group=group)
    step = quiet_compile_cache(policy).get(StepKey("bench", "decode", batch, CAPACITY, "float32"), StepSpec(fn))
    layers = stage.stop - stage.start if group is not None else args.num_hidden_layers
    a = args
    cache = KVCache.allocate(layers, batch, a.num_key_value_heads, CAPACITY, a.dim_per_head, mx.float32)
    tokens, times = [1] * batch, []
    for i in range(steps + 3):  # 3 untimed: the compile and two warm steps
        if i == 3:
            cpu = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        inputs = mx.array([tokens, [START + i % 64] * batch], mx.int32)  # [2, B]: tokens, positions
        if group is not None:
            inputs = pipeline.broadcast(inputs, group)
        out, cache = step(loaded.params, inputs[0], inputs[1], cache)
        if group is None or stage.last:
            out = mx.argmax(out, axis=-1)
        mx.eval(out, cache)
        if group is None or stage.last:
            tokens = out.tolist()  # the engine reads each step's tokens back
        times.append(time.perf_counter() - start)
    end = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall_ms": _median_ms(times[3:]),
        "wall_min_ms": min(times[3:]) * 1e3,
        "user_ms": (end.ru_utime - cpu.ru_utime) * 1e3 / steps,
        "sys_ms": (end.ru_stime - cpu.ru_stime) * 1e3 / steps,
    }


def _comm_ms(group, batch: int, hidden: int, repeats: int = 50) -> dict:
    """Median and smallest ms of the broadcast of a step's inputs, and of a [batch, 1, hidden]
    float32 round trip between ranks 1 and 0 (rank 1 sends, rank 0 sends it back)."""
    bcast, trip = [], []
    x = mx.ones((batch, 1, hidden), mx.float32)
    for _ in range(repeats):
        start = time.perf_counter()
        pipeline.broadcast(mx.zeros((2, batch), mx.int32), group)
        bcast.append(time.perf_counter() - start)
        start = time.perf_counter()
        if group.rank() == 1:
            mx.eval(mx.distributed.send(x, 0, group=group))
            mx.eval(mx.distributed.recv_like(x, 0, group=group))
        elif group.rank() == 0:
            mx.eval(mx.distributed.send(mx.distributed.recv_like(x, 1, group=group), 1, group=group))
        trip.append(time.perf_counter() - start)
    return {
        "broadcast_ms": _median_ms(bcast),
        "broadcast_min_ms": min(bcast) * 1e3,
        "hidden_round_trip_ms": _median_ms(trip),
        "hidden_round_trip_min_ms": min(trip) * 1e3,
    }


def worker(model: str, batches: list[int], policies: list[str], steps: int, out: Path) -> None:
    """One process of a round: the whole model (no group) or this rank's stage; writes
    ``out/rank{r}.json``."""
    group = mx.distributed.init(strict=True) if "MLX_RANK" in os.environ else None
    size, rank = (group.size(), group.rank()) if group else (1, 0)
    layout = model_layout(model, mx.float32, "dequantized")
    stage = layout.split(size)[rank]
    loaded = load_stage(model, stage, mx.float32, "dequantized")
    result: dict = {"rank": rank, "ranks": size, "layers": [stage.start, stage.stop], "active_bytes": 0}
    result["active_bytes"] = mx.get_active_memory()
    result["whole_bytes"] = sum(layout.layer_bytes) + layout.embed_bytes + layout.head_bytes
    result["decode_ms"] = {
        f"b{batch}-{policy}": _decode_loop(loaded, group, batch, policy, steps)
        for batch in batches
        for policy in policies
    }
    if group is not None:
        result["comm"] = {f"b{b}": _comm_ms(group, b, loaded.args.hidden_size) for b in batches}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def _round(ranks: int, argv: list[str], env: dict[str, str]) -> list[dict]:
    """One process (ranks 1) or an mlx.launch group; returns each rank's JSON. mlx.launch runs
    as `stepserve launch` runs it (:data:`service.process.launch.MLX_LAUNCH`, its stdin a pipe
    never written): without its busy loop, which would take cores from the ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "service.bench.pipeline", "--worker", *argv, "--out", tmp]
        if ranks > 1:
            launch = [sys.executable, "-c", MLX_LAUNCH, "--backend", "ring", "-n", str(ranks)]
            command = [*launch, "--hosts", "127.0.0.1", "--starting-port", str(free_ports(ranks)), "--", *command]
        stdin, keep = os.pipe()
        try:
            subprocess.run(command, check=True, timeout=1800, env=env, stdin=stdin)
        finally:
            os.close(stdin)
            os.close(keep)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(ranks)]


def _over_rounds(rounds: list[tuple[list[dict], list[dict]]], group: int, key: str, figure: str) -> float:
    """The median over rounds of ``figure`` for ``key``: rank 0's for wall times (the step as
    the engine sees it; ``wall_min_ms`` the fastest step of a round), the sum over the group's
    processes for CPU time."""
    procs = [r[group][:1] if figure.startswith("wall") else r[group] for r in rounds]
    return statistics.median(sum(p["decode_ms"][key][figure] for p in ps) for ps in procs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepserve bench pipeline", description=__doc__)
    parser.add_argument("--model", default=None, help="GGUF file or model directory (default: the default model)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--compile", nargs="+", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per batch and policy")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of one process and the group")
    parser.add_argument(
        "--blas-threads", type=int, default=None, help="OPENBLAS_NUM_THREADS for every process (default: OpenBLAS's)"
    )
    parser.add_argument(
        "--pin", action="store_true", help="rank r on core r, one process on core 0 (Linux); implies --blas-threads 1"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    model = args.model or str(default_model_path())
    if args.worker:
        worker(model, args.batches, args.compile, args.steps, args.out)
        return 0
    passed = ["--model", model, "--batches", *map(str, args.batches), "--compile", *args.compile]
    passed += ["--steps", str(args.steps)]
    env = dict(os.environ)
    if args.pin:
        env["STEPSERVE_BENCH_PIN"], args.blas_threads = "1", 1
    if args.blas_threads:
        env["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    rounds = [(_round(1, passed, env), _round(args.ranks, passed, env)) for _ in range(args.rounds)]
    table = {}
    for key in rounds[0][0][0]["decode_ms"]:
        table[key] = {
            f"{name}_{figure}": _over_rounds(rounds, group, key, figure)
            for name, group in (("one_process", 0), ("ranks", 1))
            for figure in ("wall_ms", "wall_min_ms", "user_ms", "sys_ms")
        }
        table[key]["overhead_wall_ms"] = table[key]["ranks_wall_ms"] - table[key]["one_process_wall_ms"]
    result = {
        "what": f"median ms per decode step (capacity {CAPACITY}), one process vs {args.ranks} ranks, float32 CPU",
        "command": shlex.join(["stepserve", "bench", "pipeline", *(argv if argv is not None else sys.argv[1:])]),
        "blas_threads": args.blas_threads,
        "pinned": args.pin,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average": os.getloadavg(),
        **machine_info(in_process=True),
        "model": model,
        "decode": table,
        "comm": rounds[-1][1][0].get("comm"),
        "memory": {
            "whole_bytes": rounds[0][0][0]["active_bytes"],
            "ranks": [{k: r[k] for k in ("rank", "layers", "active_bytes")} for r in rounds[0][1]],
        },
        "rounds": rounds,
    }
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
