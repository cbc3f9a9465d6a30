"""Host-side inputs of the logits processors (:func:`models.sampling.process`), built per
step for the rows of a batch that need them; see docs/STRUCTURED_OUTPUTS.md."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from service.engine.grammar import fill_masks
from service.engine.sequence import Sequence


def processor_inputs(rows: list[Sequence | None], B: int, V: int) -> tuple[tuple[mx.array, ...], int, float]:
    """The inputs of :func:`models.sampling.process` for a batch bucket of ``B`` rows over a
    vocabulary of ``V``: bias float32 [B, V] (``logit_bias``, presence and frequency penalties
    over each row's generated tokens), allowed-token bitmask int32 [B, ceil(V / 32)] (a
    grammar's), repetition penalty float32 [B], seen tokens bool [B, V] (prompt and output).
    Rows that need no processing (or are empty) get neutral values.

    Returns (those four arrays, grammar masks computed, host seconds spent computing them).
    """
    bias = np.zeros((B, V), np.float32)
    allowed = np.full((B, (V + 31) // 32), -1, np.int32)
    repetition = np.ones((B,), np.float32)
    seen = np.zeros((B, V), np.bool_)
    grammar_rows = []
    for i, seq in enumerate(rows):
        if seq is None or not seq.params.processed:
            continue
        p = seq.params
        for token, value in p.logit_bias:
            if 0 <= token < V:
                bias[i, token] += value
        if (p.presence_penalty or p.frequency_penalty) and seq.sampled_ids:
            counts = np.bincount(np.asarray(seq.sampled_ids, np.int64), minlength=V)[:V]
            bias[i] -= p.presence_penalty * (counts > 0) + p.frequency_penalty * counts
        if p.repetition_penalty != 1:
            repetition[i] = p.repetition_penalty
            seen[i, np.asarray(seq.prompt_ids + seq.sampled_ids, np.int64) % V] = True
        if seq.matcher is not None:
            grammar_rows.append((seq.matcher, i))
    seconds = 0.0
    if grammar_rows:
        start = time.perf_counter()
        fill_masks(grammar_rows, allowed)
        seconds = time.perf_counter() - start
    arrays = (mx.array(bias), mx.array(allowed), mx.array(repetition), mx.array(seen))  # type: ignore[arg-type]
    return arrays, len(grammar_rows), seconds
