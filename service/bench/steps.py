"""Time one prefill and one decode step of the default model per compute dtype, weight
format and compile mode, in-process, and write JSON. This is how stepserve's CPU defaults
(float32, dequantized weights) were chosen: ``python -m service.bench.steps --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import mlx.core as mx

from models.blas import cpu_blas
from models.gguf import default_model_path
from models.loader import device_name, load_model
from service.engine.buckets import BucketTable
from service.engine.compile_cache import CompileCache, median_seconds
from service.engine.runner import ModelRunner

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def time_step(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` evaluated, after one untimed call (the compile)."""
    mx.eval(fn())
    return median_seconds(fn, (), repeats)


def measure(dtype: str, weights: str, compiled: bool, batch: int, capacity: int, prompt: int, repeats: int) -> dict:
    """Seconds per decode step at (batch, capacity) and per prefill at (1, prompt)."""
    model = load_model(default_model_path(), "bench", DTYPES[dtype], weights)
    buckets = BucketTable((batch,), (max(prompt, 1),), (capacity,))
    runner = ModelRunner(model, buckets, CompileCache(compiled, lambda *a: None, lambda s: None))
    decode = runner.step_fn("decode", batch, capacity)
    kv = runner.new_kv(batch, capacity)
    tokens, positions = mx.zeros((batch,), mx.int32), mx.full((batch,), capacity // 2, mx.int32)
    decode_s = time_step(lambda: decode(model.params, tokens, positions, kv), repeats)
    prefill_s = None
    if prompt:
        prefill = runner.step_fn("prefill", 1, prompt)
        prompt_kv = runner.new_kv(1, prompt)
        ids, lengths = mx.zeros((1, prompt), mx.int32), mx.array([prompt], mx.int32)
        prefill_s = time_step(lambda: prefill(model.params, ids, lengths, prompt_kv), max(1, repeats // 3))
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


def measure_load(path: Path, dtype: str, weights: str, repeats: int) -> dict:
    """Median seconds of :func:`load_model` (read, prepare and evaluate every weight)."""
    times = [load_model(path, "bench", DTYPES[dtype], weights).load_seconds for _ in range(repeats)]
    return {
        "path": str(path),
        "dtype": dtype,
        "weights": weights,
        "load_s": statistics.median(times),
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--load", type=Path, nargs="+", help="time loading these models (GGUF files or directories) instead"
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"], choices=list(DTYPES))
    parser.add_argument("--weights", nargs="+", default=["quantized", "dequantized"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--capacity", type=int, nargs="+", default=[256])
    parser.add_argument("--prompt", type=int, default=128, help="prefill length to time (0: skip prefill)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    rows = []
    if args.load:
        rows = [measure_load(p, d, w, 5) for p in args.load for d in args.dtypes for w in args.weights]
        for row in rows:
            print(json.dumps(row), flush=True)
        if args.out:
            args.out.write_text(
                json.dumps({"command": "python -m service.bench.steps " + " ".join(argv or []), "rows": rows}, indent=2)
            )
        return 0
    for dtype in args.dtypes:
        # float16 on a CPU is ~30x slower: a few repeats are enough to show it.
        repeats = 2 if dtype != "float32" and device_name() == "cpu" else args.repeats
        for weights in args.weights:
            for batch in args.batch:
                for capacity in args.capacity:
                    for compiled in (False, True):
                        row = measure(dtype, weights, compiled, batch, capacity, args.prompt, repeats)
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    result = {
        "command": "python -m service.bench.steps " + " ".join(argv or []),
        "mlx": mx.__version__,
        "device": device_name(),
        "cpu_blas": cpu_blas(),
        "machine": platform.platform(),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
