"""Warm-up sized to the host: on the CPU, time one matmul and choose how much the warm-up covers
(prompt tokens, concurrent requests) so that its estimated compute fits a time budget.

Running each planned step once on dummy inputs dominates a CPU warm-up, and its cost follows the
matmul rate of the BLAS MLX's CPU backend links, OpenBLAS or the far slower reference BLAS of
MLX's Linux wheel (:mod:`models.blas`; the rates in docs/BENCHMARKS.md, "Warm-up"). So the extent
is chosen per host rather than fixed: the largest one whose estimated compute, the planned steps'
and the rehearsals', fits ``warmup_budget_s`` (:func:`size_extent` says in which order it
shrinks). Buckets outside it run eagerly once warm-up is over
(:meth:`service.engine.compile_cache.CompileCache.seal`), never compiling under a request.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

import mlx.core as mx

from models.loader import ServedArgs
from service.engine.buckets import BucketTable
from service.engine.warmup import Step, WarmupSpec, plan

PROBE_TOKENS = 128  # rows of the probe matmul: a 128-token prompt chunk through one MLP projection
PROBE_RUNS = 5  # timed runs of the probe; the fastest counts (the least disturbed by other work)

# The rehearsals' requests beyond the long prompt and the capacity move, each prefilled at least at
# the smallest prompt bucket: per warmed concurrent request (the engine's burst, joining and
# hole-filling waves, the HTTP burst), and in all (the HTTP rehearsal's eight route requests, a
# penalties request, a prompt sent twice); the chat templates and a tool's schema add a few hundred
# tokens; each request decodes a few tokens. Read off service/engine/warmup.py's
# rehearsal_scenarios and service/api/rehearsal.py's plan and burst.
REHEARSAL_REQUESTS_PER_ROW = 5
REHEARSAL_REQUESTS = 12
REHEARSAL_TEMPLATE_TOKENS = 256
REHEARSAL_TOKENS_OUT = 4


@dataclass(frozen=True)
class Coverage:
    """What one model's warm-up covers, and why.

    Attributes:
        prompt_tokens: prompts of up to this many tokens run compiled steps (0: none).
        batch: up to this many concurrent requests do.
        rehearse: the warm-up rehearsals run (:attr:`WarmupSpec.rehearse`).
        reduced: below the CPU default extent because the host is too slow to warm it
            within the budget.
        reason: why this extent, in words (logged at start-up, shown by ``/readyz``).
        gflops: the measured matmul rate, GFLOP/s (None: not measured).
        blas: the BLAS MLX's CPU matmuls use (:func:`models.blas.cpu_blas`; None off the CPU).
        estimate_s: the estimated compute of the chosen warm-up, seconds (None: not estimated).
    """

    prompt_tokens: int
    batch: int
    rehearse: bool = True
    reduced: bool = False
    reason: str = ""
    gflops: float | None = None
    blas: str | None = None
    estimate_s: float | None = None


@functools.cache
def measure_gflops(hidden: int, intermediate: int, dtype: mx.Dtype) -> float:
    """The host's matmul rate in GFLOP/s: one [PROBE_TOKENS, hidden] x [hidden, intermediate]
    product in ``dtype`` (a model's MLP up-projection), as a linear layer runs it (``x @ W.T``,
    W [intermediate, hidden]), the fastest of :data:`PROBE_RUNS` timed runs after an untimed one
    (milliseconds with OpenBLAS, tenths of a second with the reference BLAS).

    Measured once per shape and dtype in a process: start-up measures each model's before any
    engine starts (:func:`service.process.startup.load_models`), so that no warm-up competes
    with the probe for the CPU nor runs MLX beside it.
    """
    x = mx.ones((PROBE_TOKENS, hidden), dtype)
    w = mx.ones((intermediate, hidden), dtype)
    mx.eval(x, w)
    mx.eval(x @ w.T)
    best = float("inf")
    for _ in range(PROBE_RUNS):
        start = time.perf_counter()
        mx.eval(x @ w.T)
        best = min(best, time.perf_counter() - start)
    return 2 * PROBE_TOKENS * hidden * intermediate / max(best, 1e-9) / 1e9


def layer_params(args: ServedArgs) -> int:
    """Matmul weights one token passes through in the decoder layers (all of them): the
    attention projections (Q and O of heads x head_dim, K and V of KV heads x head_dim) and the
    gated MLP's three (an MoE layer's active experts: ``num_experts_per_tok`` of
    ``moe_intermediate_size``). Embeddings and the LM head are not included."""
    hidden, d = args.hidden_size, args.dim_per_head
    attention = 2 * hidden * args.num_attention_heads * d + 2 * hidden * args.num_key_value_heads * d
    experts, expert_size = getattr(args, "num_experts_per_tok", 0), getattr(args, "moe_intermediate_size", 0)
    mlp = 3 * hidden * (experts * expert_size if experts and expert_size else args.intermediate_size)
    return args.num_hidden_layers * (attention + mlp)


def step_flops(args: ServedArgs, step: Step, verify_tokens: int = 0) -> float:
    """Floating-point operations of one run of a warm-up step (:data:`service.engine.warmup.Step`).

    A token costs 2 x :func:`layer_params` (a multiply and an add per weight, Kaplan et al. 2020,
    "Scaling Laws for Neural Language Models", section 2.1), attending over C positions
    4 x layers x C x (heads x head_dim) more (QK^T and AV), and a row's logits 2 x vocab x hidden.
    ``prefill`` (B, T) attends over T positions, ``chunk`` (B, T, C) and ``decode`` (B, C) over C;
    the samplers and processors are elementwise (counted 0). ``verify_tokens`` > 0: the step is a
    speculative verify step of that width at a decode step's (B, C) (every position's logits).
    """
    phase, batch, size, capacity = step
    per_token = 2 * layer_params(args)
    width = 4 * args.num_hidden_layers * args.num_attention_heads * args.dim_per_head
    head = 2 * args.vocab_size * args.hidden_size
    if verify_tokens:
        return batch * verify_tokens * (per_token + width * size + head)
    if phase == "prefill":
        return batch * (size * (per_token + width * size) + head)
    if phase == "chunk":
        return batch * (size * (per_token + width * capacity) + head)
    if phase == "decode":
        return batch * (per_token + width * size + head)
    return 0.0


def rehearsal_flops(args: ServedArgs, buckets: BucketTable, spec: WarmupSpec) -> float:
    """Floating-point operations of the warm-up rehearsals at ``spec`` (estimated: their
    prompts padded to prompt buckets at :func:`step_flops`' rate, attending over the long
    prompt, and their decode rows at the smallest capacity); 0 when ``spec`` warms nothing or
    does not rehearse."""
    if spec.prompt_tokens <= 0 or not spec.rehearse:
        return 0.0
    smallest, chunk = buckets.prompt[0], buckets.chunk_tokens(spec.chunk_tokens)

    def padded(tokens: int) -> int:  # a prompt's prefilled tokens: whole chunks, the last padded
        whole, rest = divmod(tokens, chunk)
        return whole * chunk + (buckets.prompt_for(rest) if rest else 0)

    long = min(spec.chunk_tokens + 40, spec.prompt_tokens)  # rehearsal_scenarios' long prompt, sent twice
    near_edge = min(buckets.capacity[0] - 2, spec.prompt_tokens)  # its capacity move
    requests = REHEARSAL_REQUESTS + REHEARSAL_REQUESTS_PER_ROW * spec.batch
    tokens = 2 * padded(long) + padded(near_edge) + requests * smallest + REHEARSAL_TEMPLATE_TOKENS
    prefill = step_flops(args, ("chunk", 1, tokens, padded(long)))
    return prefill + step_flops(args, ("decode", requests * REHEARSAL_TOKENS_OUT, buckets.capacity[0], 0))


def warmup_flops(args: ServedArgs, buckets: BucketTable, spec: WarmupSpec, verify_tokens: int = 0) -> float:
    """Estimated floating-point operations of warming ``spec``: each planned step run once, the
    verify step of each planned decode bucket when speculation is on (``verify_tokens``: its
    width) with its calibration (3 verify and 12 decode steps per batch bucket), and the
    rehearsals."""
    steps = plan(buckets, spec)
    total = sum(step_flops(args, s) for s in steps) + rehearsal_flops(args, buckets, spec)
    if verify_tokens:
        decode = [s for s in steps if s[0] == "decode"]
        total += sum(step_flops(args, s, verify_tokens) for s in decode)
        smallest = {b: min(c for _, bb, c, _ in decode if bb == b) for _, b, _, _ in decode}
        total += sum(
            3 * step_flops(args, ("decode", b, c, 0), verify_tokens) + 12 * step_flops(args, ("decode", b, c, 0))
            for b, c in smallest.items()
        )
    return total


def size_extent(
    args: ServedArgs,
    buckets: BucketTable,
    ceiling: WarmupSpec,
    gflops: float,
    budget_s: float,
    prompt_tokens: int | None = None,
    batch: int | None = None,
    rehearse: bool | None = None,
    verify_tokens: int = 0,
) -> Coverage:
    """The largest warm-up extent whose estimated compute (:func:`warmup_flops` at ``gflops``
    GFLOP/s) fits ``budget_s`` seconds.

    ``ceiling`` is the most to warm (the CPU default: prompts of 512 tokens, 4 requests, the
    rehearsals). Below it, the rehearsals go first (on a slow BLAS their dummy requests cost as
    much compute as the steps they exercise, and what they build ahead on the CPU is small),
    then prompt tokens (the prompt buckets below ``ceiling.prompt_tokens``, longest first),
    then concurrency (the batch buckets below ``ceiling.batch``). ``prompt_tokens``, ``batch``,
    ``rehearse`` given: that one is fixed (a user's setting) and only the others are sized.
    ``ceiling``'s chunk and token budget are used as they are; its ``batched_positions`` (the
    capacity decode is warmed to at batches above one) follow each candidate's prompt tokens
    at the same distance. When even the smallest candidate does not fit, nothing is warmed
    (every step then runs eagerly), unless ``prompt_tokens`` is given: then the smallest
    candidate at it.

    Returns:
        The chosen :class:`Coverage`: ``reduced`` when below ``ceiling`` in a setting the user
        left unset; ``gflops`` and ``estimate_s`` filled in, ``blas`` None.
    """
    prompts = [prompt_tokens] if prompt_tokens is not None else _ladder(buckets.prompt, ceiling.prompt_tokens)
    batches = [batch] if batch is not None else _ladder(buckets.batch, ceiling.batch)
    keep = ceiling.rehearse if rehearse is None else rehearse
    first = (prompts[-1], batches[-1], keep)
    rest = [(p, b, rehearse is not None and rehearse) for p in reversed(prompts) for b in reversed(batches)]

    def seconds(extent: tuple[int, int, bool]) -> float:
        return warmup_flops(args, buckets, _spec(ceiling, *extent), verify_tokens) / (gflops * 1e9)

    rate = f"at {gflops:.1f} GFLOP/s"
    for extent in [first, *rest] if keep else rest:
        estimate = seconds(extent)
        if estimate <= budget_s:
            why = f"an estimated {estimate:.0f} s of compute {rate}, within warmup_budget_s {budget_s:g}"
            if extent != first:
                what = f"{first[0]} tokens, {first[1]} requests" + (" and the rehearsals" if keep else "")
                why += f"; {what} would need {seconds(first):.0f} s"
            return Coverage(*extent, extent != first, why, gflops, None, estimate)
    need = seconds(rest[-1])
    over = f"the smallest warm-up needs an estimated {need:.0f} s of compute {rate}, over warmup_budget_s {budget_s:g}"
    if prompt_tokens is not None:  # the user's prompt tokens stand, with the least else
        return Coverage(*rest[-1], rest[-1] != first, over + "; warmup_prompt_tokens is set", gflops, None, need)
    why = over + ": nothing is compiled, every step runs eagerly"
    return Coverage(0, batches[0], False, True, why, gflops, None, 0.0)


def _spec(ceiling: WarmupSpec, prompt_tokens: int, batch: int, rehearse: bool) -> WarmupSpec:
    """``ceiling`` at another extent: its batched positions at the same distance past the prompt."""
    extra = None if ceiling.batched_positions is None else ceiling.batched_positions - ceiling.prompt_tokens
    positions = None if extra is None else prompt_tokens + extra
    return dataclasses.replace(
        ceiling, prompt_tokens=prompt_tokens, batch=batch, batched_positions=positions, rehearse=rehearse
    )


def _ladder(buckets: tuple[int, ...], top: int) -> list[int]:
    """The buckets below ``top``, and ``top`` itself (the ceiling need not be a bucket)."""
    return sorted({b for b in buckets if b < top} | {top})
