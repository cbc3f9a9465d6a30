"""The warm-up plan: which buckets to compile before the server says it is ready (pure
functions of the bucket table; the executor owns each step's dummy inputs,
:meth:`Executor.warm`, and :mod:`service.process.warmer` drives the warm-up)."""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.buckets import BucketTable
from service.engine.prefill import last_chunk_rows


@dataclass(frozen=True)
class WarmupSpec:
    """What to compile before serving.

    Attributes:
        prompt_tokens: prompts of up to this many tokens (chunks and whole prefills alike);
            0 warms nothing.
        batch: up to this many concurrent requests (decode batch buckets, whole-prefill rows).
        batched_positions: batches of more than one row reach the capacity buckets holding
            this many positions (a lone request: every capacity bucket); None: all.
        chunk_tokens: the engine's prefill chunk (prompt tokens per request per step).
        max_batched_tokens: the engine's token budget per step (bounds whole-prefill rows).
        rehearse: also run a few dummy requests through the engine's own step, to build the
            eager paths (slot inserts, bucket moves, prefix-cache copies) before ready.
        batched_chunks: prompts' last chunks of one (T, C) bucket run together, at (B, T, C)
            (:meth:`Executor.chunk_rows`; a pipeline group's leader runs them one by one).
        recurrent: the model keeps a recurrent state (``has_states``): a chunk never recomputes
            a position, so one that no prompt bucket fits before the largest capacity bucket
            runs a token at a time (:func:`service.engine.prefill.chunk_plan`).
        padded_prompts: prompt rows may be right-padded (``pads_prompts``); False: every
            chunk is exactly a prompt bucket (the ladder has the powers of two below its
            smallest, :func:`service.engine.buckets.unpadded_prompt_ladder`), and an odd
            remainder's last token runs alone.
    """

    prompt_tokens: int = 512
    batch: int = 1
    batched_positions: int | None = None
    chunk_tokens: int = 512
    max_batched_tokens: int = 2048
    rehearse: bool = True
    batched_chunks: bool = True
    recurrent: bool = False
    padded_prompts: bool = True


Step = tuple[str, int, int, int]  # (phase, batch, size, capacity): a compile-cache key's buckets


def warmed_batch(buckets: BucketTable, spec: WarmupSpec) -> int:
    """The batch bucket warm-up covers: that of ``spec.batch`` concurrent requests (at most the
    largest batch bucket)."""
    return buckets.batch_for(min(spec.batch, buckets.batch[-1]))


def plan(buckets: BucketTable, spec: WarmupSpec) -> list[Step]:
    """Every step function a request within ``spec`` can reach, so none compiles after ready:

    * ``prefill`` (B, T): prompts of up to ``chunk_tokens`` tokens prefilled whole, B the rows
      of one prompt bucket one call runs (at most the step's token budget of padded tokens;
      ``batch`` bounds them too);
    * ``chunk`` (1, T, C): a longer prompt's chunks, and what follows a prefix-cache hit, at
      every chunk bucket T and every staging capacity C >= T the prompts reach
      (:meth:`BucketTable.staging_for`); with ``batched_chunks``, also (B, T, C) for the one
      batch bucket B per chunk bucket that the last chunks of several prompts run at together
      (:func:`service.engine.prefill.last_chunk_rows`); one-token chunks (T = 1) too at every
      staging capacity where ``padded_prompts`` is off, at the largest where only ``recurrent``
      is on (:func:`service.engine.prefill.chunk_plan`);
    * ``decode`` (B, C): batch 1 at every capacity bucket, larger batches up to ``batch`` at the
      capacities of ``batched_positions``;
    * the sampler, the logits processors and the logprobs of every batch bucket above, and the
      shapeless greedy step.
    """
    if spec.prompt_tokens <= 0:
        return []
    limit = buckets.capacity[-1]
    chunk_top = buckets.prompt_for(buckets.chunk_tokens(spec.chunk_tokens))
    chunk_ts = [t for t in buckets.prompt if t <= chunk_top]
    whole_ts = [t for t in chunk_ts if t <= buckets.prompt_for(min(spec.prompt_tokens, chunk_top))]
    rows = warmed_batch(buckets, spec)
    whole_tokens = max(spec.max_batched_tokens, spec.chunk_tokens)  # padded tokens of one whole prefill
    prefill = []
    for i, t in enumerate(whole_ts):
        shortest = (chunk_ts[i - 1] + 1) if i else 1  # a prompt in bucket t has at least this many tokens
        admitted = max(1, min(rows, spec.max_batched_tokens // shortest))
        most = min(buckets.batch_for(admitted), buckets.prefill_rows(t, whole_tokens))
        prefill += [("prefill", b, t, 0) for b in buckets.batch if b <= most]
    staging_top = buckets.staging_for(min(spec.prompt_tokens + 1, limit))
    stagings = sorted({buckets.staging_for(c) for c in buckets.capacity if c <= staging_top})
    if 1 in chunk_ts or (spec.padded_prompts and not spec.recurrent):
        one_token = []  # stagings of one-token chunks (beyond chunk_ts)
    elif spec.padded_prompts:  # a recurrent state: only where no prompt bucket fits before the limit
        one_token = [c for c in stagings if c == buckets.staging_for(limit)]
    else:
        one_token = stagings
    chunks = [("chunk", 1, t, c) for c in stagings for t in chunk_ts if t <= c] + [
        ("chunk", 1, 1, c) for c in one_token
    ]
    if spec.batched_chunks:
        last = {(t, c): last_chunk_rows(buckets, t, whole_tokens, rows, c) for t in {*chunk_ts, 1} for c in stagings}
        chunks += [("chunk", last[t, c], t, c) for c in stagings for t in chunk_ts if t <= c and last[t, c] > 1]
        chunks += [("chunk", last[1, c], 1, c) for c in one_token if last[1, c] > 1]
    batched_top = limit if spec.batched_positions is None else buckets.capacity_for(min(spec.batched_positions, limit))
    decode = [
        ("decode", b, c, 0) for b in buckets.batch if b <= rows for c in buckets.capacity if b == 1 or c <= batched_top
    ]
    batches = sorted({b for _, b, _, _ in prefill + chunks + decode})
    samplers = [(phase, b, 0, 0) for phase in ("sample", "process", "logprobs") for b in batches]
    return prefill + chunks + decode + samplers + [("greedy", 0, 0, 0)]
