"""What the prefiller's, the runner's and the speculator's executions hand back to the engine
(:class:`RunnerOutput`), the decode step the runner keeps in flight between engine steps
(:class:`DecodeStep`), and how a step's input tokens come from the one before it
(:func:`input_tokens`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from service.engine.sequence import Sequence
from service.metrics import SpecStat, StepStat


@dataclass
class RunnerOutput:
    """What one execution produced, for the engine to apply.

    Attributes:
        tokens: (request, its new token id) in batch order; the engine appends each and
            finishes the requests that stop.
        failed: (request, error message) for requests whose step raised.
        steps: one stat per step that ran (seconds from queueing to tokens read back).
        moves: decode-cache bucket moves made ("batch", "capacity").
        keys: (request, its next PRNG key uint32 [2]) for the seeded requests prefilled: the
            engine keeps them in the decode batch (:meth:`DecodeBatch.keep_key`).
        masks / mask_seconds: grammar masks computed and the host seconds they took.
    """

    tokens: list[tuple[Sequence, int]] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)
    steps: list[StepStat] = field(default_factory=list)
    moves: list[str] = field(default_factory=list)
    masks: int = 0  # grammar masks computed (rows x steps)
    mask_seconds: float = 0.0  # host seconds spent computing them
    spec: list[SpecStat] = field(default_factory=list)  # one per verify step (service.engine.speculative)
    keys: list[tuple[Sequence, mx.array]] = field(default_factory=list)  # seeded rows' next PRNG keys (prefill)


@dataclass
class DecodeStep:
    """A decode step queued on the device whose tokens have not been read back yet.

    Attributes:
        rows: the request in each batch row when the step was queued (None: empty slot).
        tokens: int32 [B], the step's selected tokens (lazy until read back).
        queued: ``time.perf_counter()`` when it was queued.
        bucket: (batch, capacity) bucket it ran at.
    """

    rows: list[Sequence | None]
    tokens: mx.array
    queued: float
    bucket: tuple[int, int]
    logprobs: tuple[mx.array, mx.array, mx.array] | None = None  # see models.sampling.logprobs
    observed: list[int] | None = None  # its tokens, once read back early for stateful rows


def input_tokens(rows: list[Sequence | None], prev: DecodeStep | None, pending: dict[int, int]) -> mx.array:
    """int32 [B]: each row's newest token, taken on the device from the queued step ``prev``
    where that step produced it, from Python otherwise (just prefilled)."""
    src = [pending.get(id(s), -1) if s is not None else -1 for s in rows]
    steady = all(j == i for i, j in enumerate(src) if rows[i] is not None)
    if prev is not None and prev.tokens.shape[0] == len(rows) and steady:
        return prev.tokens  # the steady state: every row stayed in its slot
    known = [s.last_token if s is not None and j < 0 else 0 for s, j in zip(rows, src, strict=True)]
    if prev is None or all(j < 0 for j in src):
        return mx.array(known, mx.int32)
    from_prev = mx.array([j >= 0 for j in src])
    gathered = prev.tokens[mx.array([max(j, 0) for j in src], mx.int32)]
    return mx.where(from_prev, gathered, mx.array(known, mx.int32))
