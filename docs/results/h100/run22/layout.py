"""Run 22: does the first chunk step on a prefix hit's staging cache build something the warm-up's
did not? ``python3 layout.py`` times, in one process, the compiled chunk step at (1, 64, 2048) on
three staging caches, each first call and a second one: a zeroed cache (what warm-up and a cold
prompt use), the prefix cache's gather (``join_blocks``: views of one padded concatenation), and
that gather copied into a zeroed cache per layer. Milliseconds, evaluated."""

import json
import time

import mlx.core as mx

from models.gguf import default_model_path
from models.kv_cache import KVCache
from models.loader import load_model
from service.bench.common import device_defaults, quiet_compile_cache
from service.engine.executor import Executor
from service.engine.prefix_cache import join_blocks

dtype, weights = device_defaults()
model = load_model(default_model_path(), "layout", getattr(mx, dtype), weights)
ex = Executor(model, quiet_compile_cache(True))
a = model.args
L, H, D, C, T, B = model.layers, a.num_key_value_heads, a.dim_per_head, 2048, 64, 32
tokens = [1 + i for i in range(T)]


def blocks(seed: int) -> list[mx.array]:
    key = mx.random.key(seed)
    return [mx.random.normal((L, 2, H, B, D), key=mx.random.split(key, 47)[i]).astype(model.dtype) for i in range(47)]


def timed(kv: KVCache) -> float:
    start = time.perf_counter()
    logits, out = ex.chunk(kv, tokens, 47 * B, 41)
    mx.eval(logits, out.keys, out.values)
    return (time.perf_counter() - start) * 1e3


def gathered(seed: int) -> KVCache:
    kv = join_blocks(blocks(seed), C)
    mx.eval(kv.keys, kv.values)
    return kv


def copied(seed: int) -> KVCache:
    src = gathered(seed)
    zeros, at = ex.new_kv(1, C), mx.array([0, 0, 0, 0])
    keys = [mx.slice_update(z, k, at, (0, 1, 2, 3)) for z, k in zip(zeros.keys, src.keys, strict=True)]
    values = [mx.slice_update(z, v, at, (0, 1, 2, 3)) for z, v in zip(zeros.values, src.values, strict=True)]
    kv = KVCache(keys, values)
    mx.eval(kv.keys, kv.values)
    return kv


out = {}
for name, make in [("zeros", lambda s: ex.new_kv(1, C)), ("gathered", gathered), ("copied", copied)]:
    out[name] = [round(timed(make(s)), 2) for s in range(3)]
    print(name, out[name], flush=True)
out["device"] = str(mx.default_device())
print(json.dumps(out))
