"""``stepserve bench --micro``: plain vs compiled, in-process, on MLX's default device.

* GELU on (32, 1000, 4096) float32, the example of MLX's compile guide
  (https://ml-explore.github.io/mlx/build/html/usage/compile.html);
* 20 chained ``tanh`` on (512, 512), a compile lesson's example: a long elementwise chain;
* one decode step of the default model per capacity bucket, eager vs compiled.

Compiled functions come from the compile cache, like the server's. Prints and writes JSON;
figures are milliseconds per evaluated call (median). Measurements: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from models.default import default_model_path
from models.loader import load_model
from service.bench.common import device_defaults, machine_info, quiet_compile_cache, warm_median_seconds
from service.engine.compile_cache import StepKey, StepSpec
from service.engine.executor import Executor


def gelu(x: mx.array) -> mx.array:
    """Exact GELU, x * Phi(x) (Hendrycks & Gimpel 2016), written elementwise as in MLX's guide."""
    return x * (1 + mx.erf(x / math.sqrt(2))) / 2


def tanh_chain(x: mx.array) -> mx.array:
    """20 chained tanh: a long elementwise chain that compilation can fuse."""
    for _ in range(20):
        x = mx.tanh(x)
    return x


def median_ms(fn: Callable[..., mx.array], args: tuple, repeats: int) -> float:
    """Milliseconds per evaluated call (median of ``repeats``), after one untimed call."""
    return warm_median_seconds(fn, args, repeats) * 1e3


def plain_vs_compiled(name: str, fn: Callable[[mx.array], mx.array], shape: tuple[int, ...], repeats: int) -> dict:
    """``fn`` on a float32 normal array of ``shape``, plain and compiled through the compile
    cache: ``plain_ms``, ``compiled_ms`` (median milliseconds) and ``speedup`` (plain / compiled)."""
    compiled = quiet_compile_cache("on").get(StepKey("micro", name, 0, 0, "float32"), StepSpec(fn))
    x = mx.random.normal(shape)
    mx.eval(x)
    plain_ms, compiled_ms = median_ms(fn, (x,), repeats), median_ms(compiled, (x,), repeats)
    return {
        "name": name,
        "shape": list(shape),
        "plain_ms": plain_ms,
        "compiled_ms": compiled_ms,
        "speedup": plain_ms / compiled_ms,
    }


def decode_steps(capacities: list[int], batch: int, repeats: int) -> list[dict]:
    """One decode step of the default model (stepserve's dtype and weights for the device) at
    ``(batch, capacity)`` for each capacity, every row at position capacity/2: ``eager_ms``,
    ``compiled_ms`` (median milliseconds) and ``speedup``."""
    dtype, weights = device_defaults()
    model = load_model(default_model_path(), "micro", getattr(mx, dtype), weights)
    rows = []
    for capacity in capacities:
        times = {}
        for policy in ("off", "on"):
            executor = Executor(model, quiet_compile_cache(policy))
            step = executor.step_fn("decode", batch, capacity)
            args = (
                model.params,
                mx.zeros((batch,), mx.int32),
                mx.full((batch,), capacity // 2, mx.int32),
                executor.new_kv(batch, capacity, ring=True),
            )
            times[policy] = median_ms(step, args, repeats)
        rows.append(
            {
                "bucket": f"b{batch}x{capacity}",
                "eager_ms": times["off"],
                "compiled_ms": times["on"],
                "speedup": times["off"] / times["on"],
            }
        )
    return rows


def main(argv: list[str]) -> int:
    """``stepserve bench --micro [options]``: print the JSON (and write it to ``--out``). Returns 0."""
    parser = argparse.ArgumentParser(
        prog="stepserve bench --micro", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--micro", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--capacity", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = {
        "command": "stepserve bench " + " ".join(argv),
        **machine_info(in_process=True),
        "elementwise": [
            plain_vs_compiled("gelu", gelu, (32, 1000, 4096), max(2, args.repeats // 3)),
            plain_vs_compiled("tanh20", tanh_chain, (512, 512), args.repeats * 5),
        ],
        "decode": decode_steps(args.capacity, args.batch, args.repeats),
    }
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0
