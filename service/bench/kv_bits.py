"""``stepserve bench kv-bits``: quantized KV (``kv_bits``) against full precision, in-process.

Greedy decoding of a prompt set (each a chat-templated request) through the paged decode step
the server runs (:class:`service.engine.executor.Executor`: a prefill, its keys and values
written into the pool's blocks, then decode steps over the block tables), all prompts as the
rows of one batch, once with a full-precision pool and once per ``--bits`` with a quantized one.
For each bit width it reports:

* ``free_running_agreement``: the fraction of positions where the quantized run's own greedy
  continuation has the full-precision run's token (issue #28's criterion; one flipped argmax
  changes everything after it, so this measures drift as much as error);
* ``mean_first_divergence``: the mean position of each prompt's first differing token (a prompt
  that never differs counts as ``--max-tokens``), and ``prompts_identical``;
* ``teacher_forced_agreement``: the full-precision run's tokens fed to the quantized pool, the
  fraction of positions whose argmax is the full-precision token (the per-token agreement, not
  polluted by drift);
* ``pool_bytes_per_token`` and ``memory_ratio`` (against the full-precision pool).

Position 0 comes from the prefill, which the server runs as this does: straight into the
pool's blocks for a hand-written family, so with ``--bits`` its queries attend over the
prompt's keys quantized (as mlx-lm's ``QuantizedKVCache`` has a prompt do); on a staging cache
at full precision otherwise. ``--mlx-lm 8`` adds the same figures for mlx-lm's own model class
(the GGUF read as ``model_impl = "mlx_lm"`` reads it) with and without its
``QuantizedKVCache`` (as ``generate_step(kv_bits=..., quantized_kv_start=0)``, one prompt at a
time; its teacher-forced run in one causal pass; ``--mlx-lm-prompts`` of the prompts): the
reference agreement for quantized KV on this model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from service.bench.common import machine_info

TOPICS = [
    "the history of the printing press", "how bees find flowers", "why the sky is blue",
    "the rules of chess", "how a bicycle stays upright", "the water cycle", "what a compiler does",
    "how tides work", "the life of a star", "why bread rises", "how vaccines train the body",
    "the causes of the seasons", "how a refrigerator cools", "what makes a good map",
    "the migration of birds", "how paper is made", "why cats purr", "how rainbows form",
    "the invention of the telephone", "how coral reefs grow",
]  # fmt: skip
GROUP_SIZE = 64


def prompts(n: int) -> list[str]:
    """``n`` user messages (cycling over :data:`TOPICS`)."""
    return [f"Write a short explanation of {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def paged_greedy(
    model: Any, prompt_ids: list[list[int]], steps: int, bits: int | None, forced: np.ndarray | None, block_tokens: int
) -> tuple[np.ndarray, int, int]:
    """Greedy decoding of every prompt as one batch over a paged pool (``bits``: quantized).

    Args:
        model: a :class:`models.loader.LoadedModel` of a hand-written family.
        prompt_ids: B prompts' token ids.
        steps: tokens per prompt.
        bits: kv_bits (4, 8) or None (the compute dtype).
        forced: int [B, steps] tokens to feed instead of the run's own (teacher forcing), or None.
        block_tokens: the pool's block size.

    Returns:
        (int [B, steps] each position's argmax, the pool's bytes, its token positions).
    """
    from service.engine.compile_cache import CompileCache
    from service.engine.executor import Executor, PagedTables

    executor = Executor(model, CompileCache(False, lambda *_: None, lambda _: None))
    B, longest = len(prompt_ids), max(map(len, prompt_ids))
    M = -(-(longest + steps) // block_tokens)  # table columns: every row's positions
    executor.use_paged(B * M + 1, block_tokens, bits, GROUP_SIZE)
    table = np.arange(1, B * M + 1, dtype=np.int32).reshape(B, M)  # block 0: the null block
    first = []
    for b, ids in enumerate(prompt_ids):
        blocks = table[b, : -(-len(ids) // block_tokens)].tolist()
        if executor.in_blocks:  # the prompt is prefilled straight into its blocks (quantized with bits)
            logits = executor.prefill_blocks([blocks], [ids], [0], [len(ids)], 1)
        else:
            logits, kv = executor.prefill([ids], [len(ids)])
            executor.write_blocks(kv, 0, blocks, len(ids))
        first.append(logits[0])
    logits = mx.stack(first)
    tables = PagedTables(mx.array(table), B, M * block_tokens)
    positions = [len(ids) for ids in prompt_ids]
    out = np.zeros((B, steps), np.int64)
    for step in range(steps):
        top = mx.argmax(logits, axis=-1).astype(mx.int32)
        out[:, step] = np.array(top)
        if step + 1 == steps:
            break
        feed = top if forced is None else mx.array(forced[:, step], mx.int32)
        logits, _ = executor.decode(tables, feed, positions)
        positions = [p + 1 for p in positions]
    pool = executor.pool
    assert pool is not None
    return out, pool.nbytes, pool.num_blocks * block_tokens


def mlx_lm_greedy(module: Any, ids: list[int], steps: int, bits: int | None, forced: Sequence[int] | None) -> list[int]:
    """One prompt's greedy tokens through mlx-lm's module and caches, as ``generate_step`` runs
    them with ``kv_bits=bits, quantized_kv_start=0``: the prompt but its last token prefilled
    into plain caches, converted to ``QuantizedKVCache`` (``bits``), then one token per step.
    ``forced``: those tokens fed instead of the run's own, in one causal forward pass (each
    query attends over the quantized keys and values up to itself, as a step would)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(module)
    prompt = mx.array(ids)
    module(prompt[None, :-1], cache=cache)
    if bits:
        cache = [c.to_quantized(group_size=GROUP_SIZE, bits=bits) for c in cache]
    if forced is not None:
        fed = mx.array([ids[-1], *forced[: steps - 1]])
        return mx.argmax(module(fed[None], cache=cache)[0], axis=-1).tolist()  # type: ignore[return-value]
    y, out = prompt[-1:], []
    for _ in range(steps):
        logits = module(y[None], cache=cache)[:, -1, :]
        out.append(int(np.array(mx.argmax(logits, axis=-1))[0]))
        y = mx.array([out[-1]])
    return out


def agreement(reference: np.ndarray, got: np.ndarray, forced: np.ndarray | None = None) -> dict[str, Any]:
    """Free-running figures of ``got`` [B, T] against ``reference`` [B, T] and, with ``forced``
    (the teacher-forced argmax [B, T]), its agreement."""
    B, T = reference.shape
    same = reference == got
    first = [int(np.argmin(row)) if not row.all() else T for row in same]
    row = {
        "free_running_agreement": round(float(same.mean()), 4),
        "mean_first_divergence": round(float(np.mean(first)), 1),
        "first_divergence": first,
        "prompts_identical": f"{sum(f == T for f in first)}/{B}",
    }
    if forced is not None:
        row["teacher_forced_agreement"] = round(float((forced == reference).mean()), 4)
        row["teacher_forced_disagreements"] = int((forced != reference).sum())
    return row


def measure(
    model_path: Path, n: int, steps: int, bits_list: list[int], block_tokens: int, lm: list[int], lm_n: int
) -> dict:
    """Every figure of the module doc for the model at ``model_path`` in float32, its weights as
    the server keeps them on this device (``weights = "auto"``: dense on the CPU)."""
    from models.loader import load_model
    from service.process.startup import weights_mode

    model = load_model(model_path, "bench", mx.float32, weights_mode("auto"), impl="native")
    tok = model.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in prompts(n)]
    start = time.perf_counter()
    reference, full_bytes, positions = paged_greedy(model, ids, steps, None, None, block_tokens)
    forced_full, _, _ = paged_greedy(model, ids, steps, None, reference, block_tokens)
    assert (forced_full == reference).all(), "teacher forcing the full-precision run changed its own argmax"
    rows: list[dict[str, Any]] = [{"kv_bits": None, "pool_bytes_per_token": full_bytes / positions}]
    for bits in bits_list:
        own, nbytes, _ = paged_greedy(model, ids, steps, bits, None, block_tokens)
        forced, _, _ = paged_greedy(model, ids, steps, bits, reference, block_tokens)
        row = {
            "kv_bits": bits,
            **agreement(reference, own, forced),
            "pool_bytes_per_token": nbytes / positions,
            "memory_ratio": round(nbytes / full_bytes, 4),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result: dict[str, Any] = {"stepserve": rows, "stepserve_seconds": round(time.perf_counter() - start, 1)}
    if lm:
        result["mlx_lm"] = measure_mlx_lm(model_path, ids[:lm_n], steps, lm, reference[:lm_n])
    return result


def measure_mlx_lm(model_path: Path, ids: list[list[int]], steps: int, bits_list: list[int], ours: np.ndarray) -> dict:
    """:func:`measure`'s figures for mlx-lm's own model class and caches (float32), and how its
    full-precision tokens agree with stepserve's (``ours`` [B, T])."""
    from models.lm_loader import load_lm_dir, load_lm_gguf
    from service.process.startup import weights_mode

    load = load_lm_dir if model_path.is_dir() else load_lm_gguf
    _, module, _ = load(model_path, mx.float32, weights_mode("auto"))
    reference = np.array([mlx_lm_greedy(module, p, steps, None, None) for p in ids])
    same = agreement(ours, reference)
    rows: list[dict[str, Any]] = [
        {"kv_bits": None, "prompts": len(ids), "stepserve_full_precision_agreement": same["free_running_agreement"]}
    ]
    print(json.dumps({"mlx_lm": rows[0]}), flush=True)
    for bits in bits_list:
        own = np.array([mlx_lm_greedy(module, p, steps, bits, None) for p in ids])
        forced = np.array(
            [mlx_lm_greedy(module, p, steps, bits, r.tolist()) for p, r in zip(ids, reference, strict=True)]
        )
        row = {"kv_bits": bits, **agreement(reference, own, forced)}
        rows.append(row)
        print(json.dumps({"mlx_lm": row}), flush=True)
    return {"rows": rows}


def main(argv: list[str]) -> int:
    """``stepserve bench kv-bits [--model PATH] [--prompts N] [--max-tokens T] [--bits 8 4]
    [--mlx-lm [BITS ...]] [--mlx-lm-prompts N] [--out FILE]``. Returns 0."""
    parser = argparse.ArgumentParser(prog="stepserve bench kv-bits", description=__doc__)
    parser.add_argument("--model", type=Path, help="GGUF or model directory (default: the default model)")
    parser.add_argument("--prompts", type=int, default=20, help="prompts (one batch)")
    parser.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per prompt")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4], choices=[4, 8])
    parser.add_argument("--block-tokens", type=int, default=16, help="the pool's kv_block_tokens")
    parser.add_argument(
        "--mlx-lm",
        type=int,
        nargs="*",
        choices=[4, 8],
        default=[],
        help="mlx-lm's QuantizedKVCache too, at these bits",
    )
    parser.add_argument("--mlx-lm-prompts", type=int, help="prompts for --mlx-lm (the first N; default: all)")
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    args = parser.parse_args(argv)
    from service.process.startup import model_path, weights_mode

    path = model_path(args.model)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": "stepserve bench kv-bits " + " ".join(argv),
        "commit": commit or None,
        "date": time.strftime("%Y-%m-%d"),
        **machine_info(in_process=True),
        "model": path.name,
        "compute_dtype": "float32",
        "weights": weights_mode("auto"),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "group_size": GROUP_SIZE,
        **measure(
            path,
            args.prompts,
            args.max_tokens,
            args.bits,
            args.block_tokens,
            args.mlx_lm,
            args.mlx_lm_prompts or args.prompts,
        ),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0
