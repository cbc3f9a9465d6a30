"""Run 27: is a prefix hit's first-use cost the gather's block count? ``python3 gather.py`` times,
in one process, ``join_blocks`` (the prefix cache's gather: one concatenation of N blocks, then a
copy per layer into zeroed buffers) on fresh random blocks, each N twice in a row, for N in an
order that revisits some; then the same N after the compiled chunk step, as a hit runs them.
Milliseconds, evaluated. The default model's shapes (block 32 tokens, capacity 2,048)."""

import json
import time

import mlx.core as mx

from models.gguf import default_model_path
from models.loader import load_model
from service.bench.common import device_defaults, quiet_compile_cache
from service.engine.executor import Executor
from service.engine.prefix_cache import join_blocks

dtype, weights = device_defaults()
model = load_model(default_model_path(), "gather", getattr(mx, dtype), weights)
ex = Executor(model, quiet_compile_cache(True))
a = model.args
L, H, D, C, T, B = model.layers, a.num_key_value_heads, a.dim_per_head, 2048, 64, 32
tokens = [1 + i for i in range(T)]
seed = [0]


def blocks(n: int) -> list[mx.array]:
    seed[0] += 1
    out = [
        mx.random.normal((L, 2, H, B, D), key=mx.random.key(seed[0] * 1000 + i)).astype(model.dtype) for i in range(n)
    ]
    mx.eval(out)
    return out


def gather(n: int) -> float:
    bs = blocks(n)
    start = time.perf_counter()
    kv = join_blocks(bs, C)
    mx.eval(kv.keys, kv.values)
    return round((time.perf_counter() - start) * 1e3, 2)


def hit(n: int) -> float:
    bs = blocks(n)
    start = time.perf_counter()
    kv = join_blocks(bs, C)
    logits, out = ex.chunk(kv, tokens, n * B, 41)
    mx.eval(logits, out.keys, out.values)
    return round((time.perf_counter() - start) * 1e3, 2)


out: dict = {"gather": [], "hit": []}
for n in [17, 17, 47, 47, 47, 30, 30, 47, 64, 64, 31, 31, 48, 48]:
    out["gather"].append((n, gather(n)))
    print("gather", out["gather"][-1], flush=True)
warm_logits, warm_kv = ex.chunk(ex.new_kv(1, C), tokens, 0, 41)  # compiles the chunk step
mx.eval(warm_logits, warm_kv.keys, warm_kv.values)
for n in [47, 47, 20, 20, 47, 55, 55]:
    out["hit"].append((n, hit(n)))
    print("hit", out["hit"][-1], flush=True)
out["device"] = str(mx.default_device())
print(json.dumps(out))
