"""Pipeline parallelism: a Llama-family model's layers split into contiguous stages, one per
process of an ``mx.distributed`` group, as pure step functions.

Layout (mlx-lm's ``PipelineMixin`` order): the **first** stage (the embedding and the first
layers) runs on the **highest** rank, the **last** stage (the last layers, the final norm and
the head) on **rank 0**. Hidden states flow rank N-1 -> N-2 -> ... -> 0, each hop a ring
neighbour, and rank 0, which runs the scheduler and the sampler, gets the logits from its own
head: logits [B, V] never cross a link (V / H is 85 for SmolLM2, 16 for Llama 3 70B), and the
tokens the first stage needs arrive with the step's inputs, which rank 0 sends every rank anyway
(:func:`broadcast`). A model with tied embeddings holds the table on both ends (the first
stage's embedding, the last stage's head); the split counts it twice.

Each rank runs the same step function with the same bucketed shapes on its own stage's
parameters and KV cache; only the stage (static, like the hyper-parameters) differs. The
functions take the same arrays as :mod:`models.llama`'s and return, on rank 0, the same
logits; on the other ranks an array whose evaluation sends the stage's output on (evaluate it
with the cache, then drop it). Shapes as in :mod:`models.llama`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from models.attention import CacheAttention, PromptAttention
from models.kv_cache import KVCache
from models.layers import Params, embed, linear
from models.llama import LLAMA, Cache, run_blocks
from models.model_args import ModelArgs
from models.paged import PagedKV, paged_attention


@dataclass(frozen=True)
class Stage:
    """One process's share of the model.

    Attributes:
        rank: the process's rank in the group; stage position ``size - 1 - rank``.
        size: processes in the group.
        start: its first layer's index.
        stop: one past its last layer's index (``start < stop``).
        tied: the model's head is its embedding table.
        nbytes: bytes of the parameters it holds (as the split counted them).
    """

    rank: int
    size: int
    start: int
    stop: int
    tied: bool = True
    nbytes: int = 0

    @property
    def first(self) -> bool:
        """Runs the embedding (the highest rank)."""
        return self.rank == self.size - 1

    @property
    def last(self) -> bool:
        """Runs the final norm and the head, and so the sampler (rank 0)."""
        return self.rank == 0

    @property
    def holds_embedding(self) -> bool:
        """Holds ``embed_tokens``: the first stage, and the last when the head is tied to it."""
        return self.first or (self.last and self.tied)


def plan_stages(
    layer_bytes: Sequence[int],
    embed_bytes: int,
    head_bytes: int,
    size: int,
    *,
    tied: bool,
    capacities: Sequence[float] | None = None,
    shared_bytes: int = 0,
) -> list[Stage]:
    """Split the layers into ``size`` contiguous stages by memory.

    A stage's memory is its layers' bytes, plus ``embed_bytes`` on the first stage and
    ``head_bytes`` on the last, plus ``embed_bytes`` again on the last when the head is tied to
    the embedding (unless one stage is both), plus ``shared_bytes`` on every stage. The split minimizes the largest
    ``memory / capacity`` over the ranks: dynamic programming over the contiguous splits,
    O(size * layers^2); among equal splits, earlier stages take more layers.

    Args:
        layer_bytes: bytes of each layer, in order (weights as prepared for serving; add each
            layer's KV cache at the largest batch and capacity to balance that too).
        embed_bytes: bytes of the embedding table.
        head_bytes: bytes of the final norm and, when untied, ``lm_head``.
        size: processes in the group (>= 1).
        tied: the head is the embedding table.
        capacities: per rank, the memory it may use (any unit: only ratios count); default
            equal.
        shared_bytes: bytes every stage holds whatever its layers (mlx-lm's ``PipelineMixin``
            runs the embedding, the final norm and the head on every rank).

    Returns:
        One :class:`Stage` per rank, indexed by rank.

    Raises:
        ValueError: fewer layers than processes, or capacities of the wrong length or <= 0.
    """
    layers = len(layer_bytes)
    if size < 1 or layers < size:
        raise ValueError(f"cannot split {layers} layers over {size} processes (each needs at least one layer)")
    capacity = list(capacities) if capacities is not None else [1.0] * size
    if len(capacity) != size or min(capacity) <= 0:
        raise ValueError(f"capacities must be {size} positive numbers, one per rank; got {capacities}")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def held(position: int, start: int, stop: int) -> int:
        first, last = position == 0, position == size - 1
        ends = (embed_bytes if first else 0) + (head_bytes if last else 0)
        tied_head = embed_bytes if last and tied and not first else 0
        return prefix[stop] - prefix[start] + ends + tied_head + shared_bytes

    def cost(position: int, start: int, stop: int) -> float:
        return held(position, start, stop) / capacity[size - 1 - position]

    # best[p][i] = (the smallest largest cost of stages 0..p holding layers 0..i-1, where stage p starts)
    best = [{i: (cost(0, 0, i), 0) for i in range(1, layers - size + 2)}]
    for p in range(1, size):
        best.append(
            {
                i: min(
                    ((max(best[p - 1][j][0], cost(p, j, i)), j) for j in range(p, i)),
                    key=lambda c: (c[0], -c[1]),
                )
                for i in range(p + 1, layers - size + p + 2)
            }
        )
    stages, stop = [], layers
    for p in range(size - 1, -1, -1):
        start = best[p][stop][1]
        stages.append(Stage(size - 1 - p, size, start, stop, tied, held(p, start, stop)))
        stop = start
    return stages  # built from the last stage (rank 0) up


def stage_params(params: Params, stage: Stage) -> Params:
    """The parameters ``stage`` runs, from a whole model's tree (lazy arrays stay unread):
    its layers, ``embed_tokens`` where :attr:`Stage.holds_embedding`, and on the last stage
    ``norm`` and ``lm_head`` (when untied)."""
    out: Params = {"layers": params["layers"][stage.start : stage.stop]}
    if stage.holds_embedding:
        out["embed_tokens"] = params["embed_tokens"]
    if stage.last:
        out["norm"] = params["norm"]
        if "lm_head" in params:
            out["lm_head"] = params["lm_head"]
    return out


def broadcast(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """Rank 0's ``x`` on every rank, evaluated: how rank 0 hands each step's inputs to the
    other stages (a sum in which the other ranks add zeros; exact for integers). Every rank
    passes an array of the same shape and dtype and must call this at the same point.

    It evaluates before returning because a collective left lazy runs only on the ranks whose
    graphs read its result: rank 0's last stage never reads the tokens it broadcasts, so its
    sum would never run while the first stage waits in it, and the ring would deadlock.
    """
    out = mx.distributed.all_sum(x if group.rank() == 0 else mx.zeros_like(x), group=group)
    mx.eval(out)
    return out


def _run(
    params: Params,
    tokens: mx.array,
    offset: int | mx.array,
    cache: Cache,
    attention: Callable,
    last_rows: Callable[[mx.array], mx.array],
    args: ModelArgs,
    stage: Stage,
    group: mx.distributed.Group | None,
) -> tuple[mx.array, Cache]:
    """The stage's part of a step: embed (first stage) or receive x [B, L, H] from the rank
    above, run its layers, then send x to the rank below, or (last stage) take each row's last
    real position (``last_rows``: [B, L, H] -> [B, H]) through the norm and the head. ``cache``
    is the stage's static cache or its layers' paged pools (:class:`models.paged.PagedKV`)."""
    B, L = tokens.shape
    if stage.first:
        x = embed(tokens, params["embed_tokens"], args.quant_group_size)
    else:
        dtype = params["layers"][0]["input_layernorm"]["weight"].dtype  # the compute dtype
        x = mx.distributed.recv((B, L, args.hidden_size), dtype, stage.rank + 1, group=group)
    x, cache = run_blocks(LLAMA, params, x, offset, cache, attention, args)
    if not stage.last:
        return mx.distributed.send(x, stage.rank - 1, group=group), cache
    h = mx.fast.rms_norm(last_rows(x), params["norm"]["weight"], args.rms_norm_eps)
    head = params["lm_head"] if "lm_head" in params else params["embed_tokens"]  # an untied last stage has no table
    return linear(h, head, args.quant_group_size).astype(mx.float32), cache


def _rows_at(lengths: mx.array) -> Callable[[mx.array], mx.array]:
    """x [B, L, H] -> x[b, lengths[b] - 1] [B, H]."""
    return lambda x: mx.take_along_axis(x, (lengths - 1).astype(mx.int32)[:, None, None], axis=1)[:, 0, :]


def prefill(
    params: Params,
    tokens: mx.array,
    lengths: mx.array,
    cache: KVCache,
    *,
    args: ModelArgs,
    stage: Stage,
    group: mx.distributed.Group | None = None,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, KVCache]:
    """:func:`models.llama.prefill` for one stage: tokens int32 [B, T], lengths int32 [B],
    the stage's cache (its layers only) of capacity C >= T. Returns (rank 0: float32 logits
    [B, V]; other ranks: the sent hidden states [B, T, H], to evaluate), the stage's cache.
    ``bits``: the stage's pool is ``kv_bits``: keys and values are attended and staged as the
    pool keeps them (:func:`models.attention.kv_roundtrip`), as one process attends a prompt
    prefilled in its quantized blocks."""
    attention = PromptAttention(tokens.shape[1], args.attention_scale, bits, group_size)
    return _run(params, tokens, 0, cache, attention, _rows_at(lengths), args, stage, group)


def prefill_chunk(
    params: Params,
    tokens: mx.array,
    offsets: mx.array,
    lengths: mx.array,
    cache: KVCache,
    *,
    args: ModelArgs,
    stage: Stage,
    group: mx.distributed.Group | None = None,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, KVCache]:
    """:func:`models.llama.prefill_chunk` for one stage: tokens int32 [B, T] from offsets int32
    [B], lengths int32 [B] real tokens per row, the stage's cache with offsets + T <= C.
    Returns as :func:`prefill` (``bits`` as there)."""
    positions = offsets[:, None] + mx.arange(tokens.shape[1])[None, :]  # [B, T]
    attention = CacheAttention(positions, args.attention_scale, bits, group_size)
    return _run(params, tokens, offsets, cache, attention, _rows_at(lengths), args, stage, group)


def decode(
    params: Params,
    tokens: mx.array,
    positions: mx.array,
    cache: KVCache,
    *,
    args: ModelArgs,
    stage: Stage,
    group: mx.distributed.Group | None = None,
) -> tuple[mx.array, KVCache]:
    """:func:`models.llama.decode` for one stage: tokens int32 [B], positions int32 [B] (< C),
    the stage's cache. Returns (rank 0: float32 logits [B, V]; other ranks: the sent hidden
    states [B, 1, H], to evaluate), the stage's cache."""
    attention = CacheAttention(positions[:, None], args.attention_scale)
    return _run(params, tokens[:, None], positions, cache, attention, lambda x: x[:, 0, :], args, stage, group)


def decode_paged(
    params: Params,
    tokens: mx.array,
    positions: mx.array,
    table: mx.array,
    pool: PagedKV,
    *,
    args: ModelArgs,
    stage: Stage,
    group: mx.distributed.Group | None = None,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, PagedKV]:
    """:func:`models.llama.decode_paged` for one stage: tokens int32 [B], positions int32 [B]
    (< M * bt), table int32 [B, M] (each row's blocks, null-block padded: rank 0's block ids,
    the same on every rank), the stage's pools (its layers only, [N, Hkv, bt, D] each; with
    ``bits`` quantized triples). Returns (rank 0: float32 logits [B, V]; other ranks: the sent
    hidden states [B, 1, H], to evaluate), the stage's pools with each row's token written."""
    attention = paged_attention(table, positions[:, None], args.attention_scale, bits, group_size)
    return _run(params, tokens[:, None], positions, pool, attention, lambda x: x[:, 0, :], args, stage, group)
