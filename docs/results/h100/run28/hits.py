"""Run 28: a prefix hit's first-use cost by block count, before and after padding the gather's
concatenation to a power of two. ``python3 hits.py N...`` (from the repository root, or from a
copy of the code before) times, in one process, a hit as the engine runs it: the gather of N
fresh random blocks into a 2,048-position staging cache (``join_blocks``) and the compiled chunk
step on it, evaluated, for each N in turn. Milliseconds; the default model's shapes."""

import json
import sys
import time

import mlx.core as mx

from models.gguf import default_model_path
from models.loader import load_model
from service.bench.common import device_defaults, quiet_compile_cache
from service.engine.executor import Executor
from service.engine.prefix_cache import join_blocks

dtype, weights = device_defaults()
model = load_model(default_model_path(), "hits", getattr(mx, dtype), weights)
ex = Executor(model, quiet_compile_cache(True))
a = model.args
L, H, D, C, T, B = model.layers, a.num_key_value_heads, a.dim_per_head, 2048, 64, 32
tokens = [1 + i for i in range(T)]


def hit(n: int, seed: int) -> float:
    keys = [mx.random.key(seed * 1000 + i) for i in range(n)]
    blocks = [mx.random.normal((L, 2, H, B, D), key=k).astype(model.dtype) for k in keys]
    mx.eval(blocks)
    start = time.perf_counter()
    kv = join_blocks(blocks, C)
    logits, out = ex.chunk(kv, tokens, n * B, 41)
    mx.eval(logits, out.keys, out.values)
    return round((time.perf_counter() - start) * 1e3, 2)


warm_logits, warm_kv = ex.chunk(ex.new_kv(1, C), tokens, 0, 41)  # compiles the chunk step
mx.eval(warm_logits, warm_kv.keys, warm_kv.values)
hit(2, 0)  # the gather's kernels (any count), so each N below pays only for what is new to it
times = [(n, hit(n, i + 1)) for i, n in enumerate(int(x) for x in sys.argv[1:])]
for n, ms in times:
    print("hit", n, ms, flush=True)
print(json.dumps({"hits": times, "device": str(mx.default_device())}))
