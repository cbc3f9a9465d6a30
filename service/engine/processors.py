"""Host-side inputs of the logits processors (:func:`models.sampling.process`), built per
step for the rows of a batch that need them; see docs/STRUCTURED_OUTPUTS.md."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from service.engine.grammar import fill_masks
from service.engine.sequence import Sequence


class ProcessorInputs:
    """Builds the inputs of :func:`models.sampling.process` for a batch over a vocabulary of
    ``vocab`` ids. An input no row of the batch uses (a bias, a repetition penalty) is a
    neutral device array made once per batch bucket and reused, so a batch of grammar rows
    sends only its bitmask from the host each step."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self._neutral: dict[int, tuple[mx.array, mx.array, mx.array, mx.array]] = {}

    def neutral(self, B: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The inputs that change nothing: (bias zeros float32 [B, V], allowed all ones int32
        [B, ceil(V / 32)], repetition ones float32 [B], seen zeros bool [B, V])."""
        if B not in self._neutral:
            V = self.vocab
            words = (V + 31) // 32
            arrays = (mx.zeros((B, V)), mx.full((B, words), -1, mx.int32), mx.ones((B,)), mx.zeros((B, V), mx.bool_))
            mx.eval(arrays)
            self._neutral[B] = arrays
        return self._neutral[B]

    def build(self, rows: list[Sequence | None], B: int) -> tuple[tuple[mx.array, ...], int, float]:
        """The inputs for a batch bucket of ``B`` rows: bias float32 [B, V] (``logit_bias``,
        presence and frequency penalties over each row's generated tokens), allowed-token
        bitmask int32 [B, ceil(V / 32)] (a grammar's), repetition penalty float32 [B], seen
        tokens bool [B, V] (prompt and output). Rows that need no processing (or are empty)
        get neutral values.

        Returns (those four arrays, grammar masks computed, host seconds spent computing them).
        """
        V = self.vocab
        live = [(i, s.params, s) for i, s in enumerate(rows) if s is not None and s.params.processed]
        neutral_bias, neutral_allowed, neutral_repetition, neutral_seen = self.neutral(B)
        bias_rows = [(i, p, s) for i, p, s in live if p.logit_bias or p.presence_penalty or p.frequency_penalty]
        bias = neutral_bias
        if bias_rows:
            host = np.zeros((B, V), np.float32)
            for i, p, seq in bias_rows:
                for token, value in p.logit_bias:
                    if 0 <= token < V:
                        host[i, token] += value
                if (p.presence_penalty or p.frequency_penalty) and seq.sampled_ids:
                    counts = np.bincount(np.asarray(seq.sampled_ids, np.int64), minlength=V)[:V]
                    host[i] -= p.presence_penalty * (counts > 0) + p.frequency_penalty * counts
            bias = mx.array(host)
        repetition, seen = neutral_repetition, neutral_seen
        if repeating := [(i, p, s) for i, p, s in live if p.repetition_penalty != 1]:
            host_repetition = np.ones((B,), np.float32)
            host_seen = np.zeros((B, V), np.bool_)
            for i, p, seq in repeating:
                host_repetition[i] = p.repetition_penalty
                host_seen[i, np.asarray(seq.prompt_ids + seq.sampled_ids, np.int64) % V] = True
            repetition, seen = mx.array(host_repetition), mx.array(host_seen)  # type: ignore[arg-type]  # numpy bool arrays convert
        allowed, seconds = neutral_allowed, 0.0
        if grammar_rows := [(s.matcher, i) for i, _, s in live if s.matcher is not None]:
            start = time.perf_counter()
            host_allowed = np.full((B, (V + 31) // 32), -1, np.int32)
            fill_masks(grammar_rows, host_allowed)
            seconds = time.perf_counter() - start
            allowed = mx.array(host_allowed)
        return (bias, allowed, repetition, seen), len(grammar_rows), seconds
