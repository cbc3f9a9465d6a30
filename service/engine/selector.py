"""Token selection for one step's logits: each row's logits processors (penalties, a logit
bias, a grammar's mask), the sampler of the batch bucket (or the shapeless greedy step) and
the logprobs, each a compiled function of the compile cache run only when some row needs it
(:mod:`models.sampling`, :mod:`service.engine.processors`), and :func:`observe`, what a chosen
token changes on the host. Called only from the engine thread."""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx

from service.engine.processors import ProcessorInputs
from service.engine.sequence import Sequence, TokenLogprob

log = logging.getLogger("stepserve.engine")


class TokenSelector:
    """Picks each row's next token (see the module doc) and counts the grammar masks it built.

    Args:
        vocab: the vocabulary size V.
        step_fn: ``step_fn(phase, batch=0)``, the compiled function of a sampling phase
            (``process``, ``greedy``, ``sample``, ``logprobs``) at a batch bucket.
    """

    def __init__(self, vocab: int, step_fn: Callable[..., Callable]):
        self.vocab, self._step_fn = vocab, step_fn
        self.processor_inputs = ProcessorInputs(vocab)
        self.masks, self.mask_seconds = 0, 0.0  # grammar masks computed so far, and their host seconds

    def select(
        self, logits: mx.array, rows: list[Sequence | None], keys: list[mx.array | None], queued: bool = False
    ) -> tuple[mx.array, list[mx.array | None], tuple[mx.array, mx.array, mx.array] | None]:
        """Pick one token per row of ``logits`` [B, V] with each row's parameters.

        ``keys[i]`` is row i's PRNG key (uint32 [2]) or None (unseeded or empty row).
        Returns (tokens int32 [B], the rows' next keys, logprobs or None), all lazy: the caller
        evaluates them (the engine with ``mx.async_eval``), so keys never chain unevaluated for
        long. Each part runs only when some row needs it: the logits processors (penalties, a
        logit bias, a grammar's mask; inputs built here on the host), the sampler of batch
        bucket B (else the shapeless greedy step), the logprobs
        (:func:`models.sampling.logprobs`, of the unprocessed logits). ``queued``: the caller
        has already queued ``logits`` (``mx.async_eval``); queueing it again costs host time.
        """
        B = logits.shape[0]
        live = [s for s in rows if s is not None]
        raw = logits
        if any(s.params.processed for s in live):
            if not queued:
                mx.async_eval(logits)  # the forward pass runs while the host builds the processors' inputs
            inputs, masks, seconds = self.processor_inputs.build(rows, B)
            self.masks, self.mask_seconds = self.masks + masks, self.mask_seconds + seconds
            logits = self._step_fn("process", B)(logits, *inputs)
        lp = None
        if all(s.params.temperature == 0 for s in live):
            tokens, next_keys = self._step_fn("greedy")(logits), keys
        else:
            zero_key = mx.zeros((2,), mx.uint32)
            temperature = mx.array([s.params.temperature if s else 0.0 for s in rows], mx.float32)
            top_p = mx.array([s.params.top_p if s else 1.0 for s in rows], mx.float32)
            top_k = [min(s.params.top_k or self.vocab, self.vocab) if s else self.vocab for s in rows]
            min_p = mx.array([s.params.min_p if s else 0.0 for s in rows], mx.float32)
            seeded = mx.array([k is not None for k in keys])
            key_rows = mx.stack([k if k is not None else zero_key for k in keys])
            tokens, nk = self._step_fn("sample", B)(
                logits, temperature, top_p, mx.array(top_k, mx.int32), min_p, key_rows, seeded
            )
            next_keys = [nk[i] if k is not None else None for i, k in enumerate(keys)]
        if any(s.params.logprobs is not None for s in live):
            lp = self._step_fn("logprobs", B)(raw, tokens)
        return tokens, next_keys, lp


def observe(rows: list[Sequence | None], tokens: list[int], lp: tuple | None = None) -> None:
    """Host-side state of each row after its newest token: the generated ids that the
    penalties count, the grammar's matcher, and the token's logprobs (kept on the
    sequence until its text is emitted). ``lp``: :func:`models.sampling.logprobs`'s
    arrays for these rows, or None. Rows that are None or already finished are skipped."""
    lp_lists = [a.tolist() for a in lp] if lp is not None else None
    for i, (seq, token) in enumerate(zip(rows, tokens, strict=False)):
        if seq is None or seq.finish_reason is not None:
            continue
        seq.sampled_ids.append(token)
        if seq.matcher is not None and not seq.matcher.advance(token):
            log.warning("request %s: token %d is outside its grammar", seq.request_id, token)
        k = seq.params.logprobs
        if k is not None and lp_lists is not None:
            chosen, top_ids, top_lp = lp_lists
            top = tuple(zip(top_ids[i][:k], top_lp[i][:k], strict=True))  # type: ignore[index]
            seq.logprob_entries.append(TokenLogprob(token, chosen[i], top))  # type: ignore[index]
