"""``stepserve bench steps``: time one prefill and one decode step of the default model per
compute dtype, weight format and compile mode, in-process, and write JSON; ``--load`` times
model loading instead. This is how stepserve's CPU defaults (float32, dequantized weights)
were chosen (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import mlx.core as mx

from models.default import default_model_path
from models.loader import WeightsMode, device_name, load_model
from service.bench.common import machine_info, quiet_compile_cache, warm_median_seconds
from service.engine.executor import Executor

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
WEIGHTS: tuple[WeightsMode, ...] = ("quantized", "dequantized")


def measure(
    dtype: str, weights: WeightsMode, compiled: bool, batch: int, capacity: int, prompt: int, repeats: int
) -> dict:
    """Median seconds per decode step at (batch, capacity), every row at position capacity/2,
    and per prefill at (1, prompt) (None when ``prompt`` is 0; a third of the repeats), with
    decode tokens/s and the weights' bytes."""
    model = load_model(default_model_path(), "bench", DTYPES[dtype], weights)
    executor = Executor(model, quiet_compile_cache(compiled))
    decode = executor.step_fn("decode", batch, capacity)
    tokens, positions = mx.zeros((batch,), mx.int32), mx.full((batch,), capacity // 2, mx.int32)
    decode_args = (model.params, tokens, positions, executor.new_kv(batch, capacity, ring=True))
    decode_s = warm_median_seconds(decode, decode_args, repeats)
    prefill_s = None
    if prompt:
        prefill = executor.step_fn("prefill", 1, prompt)
        ids, lengths = mx.zeros((1, prompt), mx.int32), mx.array([prompt], mx.int32)
        prefill_args = (model.params, ids, lengths, executor.new_kv(1, prompt))
        prefill_s = warm_median_seconds(prefill, prefill_args, max(1, repeats // 3))
    return {
        "dtype": dtype,
        "weights": weights,
        "compile": compiled,
        "batch": batch,
        "capacity": capacity,
        "prompt": prompt,
        "decode_step_s": decode_s,
        "decode_tok_s": batch / decode_s,
        "prefill_s": prefill_s,
        "weights_bytes": model.nbytes,
    }


def measure_load(path: Path, dtype: str, weights: WeightsMode, repeats: int) -> dict:
    """Median seconds of :func:`models.loader.load_model` (read, prepare and evaluate every
    weight) over ``repeats`` loads. Raises ModelLoadError for a file it cannot read."""
    times = [load_model(path, "bench", DTYPES[dtype], weights).load_seconds for _ in range(repeats)]
    return {
        "path": str(path),
        "dtype": dtype,
        "weights": weights,
        "load_s": statistics.median(times),
        "repeats": repeats,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepserve bench steps", description=__doc__)
    parser.add_argument(
        "--load", type=Path, nargs="+", help="time loading these models (GGUF files or directories) instead"
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"], choices=list(DTYPES))
    parser.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=WEIGHTS)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--capacity", type=int, nargs="+", default=[256])
    parser.add_argument("--prompt", type=int, default=128, help="prefill length to time (0: skip prefill)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path)
    return parser


def _step_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    for dtype in args.dtypes:
        # float16 matmuls are far slower on a CPU (docs/BENCHMARKS.md): a few repeats show it.
        repeats = 2 if dtype != "float32" and device_name() == "cpu" else args.repeats
        for weights in args.weights:
            for batch in args.batch:
                for capacity in args.capacity:
                    for compiled in (False, True):
                        row = measure(dtype, weights, compiled, batch, capacity, args.prompt, repeats)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    """``stepserve bench steps [options]``: print one JSON line per row as it is measured and
    write them all to ``--out``. Returns 0."""
    args = _parser().parse_args(argv)
    command = "stepserve bench steps " + " ".join(argv)
    if args.load:
        rows = [measure_load(p, d, w, 5) for p in args.load for d in args.dtypes for w in args.weights]
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        rows = _step_rows(args)
    result = {"command": command, **machine_info(in_process=True), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0
