"""Token selection for one step's logits: each row's logits processors (penalties, a logit
bias, a grammar's mask), the sampler of the batch bucket (or the shapeless greedy step) and
the logprobs, each a compiled function of the compile cache run only when some row needs it
(:mod:`models.sampling`, :mod:`service.engine.processors`). Called only from the engine thread;
the processors' host inputs may be prepared on a worker thread (:meth:`TokenSelector.prepare`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx

from service.engine.processors import HostInputs, ProcessorInputs
from service.engine.sequence import Sequence


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
        self._worker: ThreadPoolExecutor | None = None  # made on the first prepare()

    def prepare(self, rows: list[Sequence | None]) -> Future[HostInputs] | None:
        """Start building the processors' host inputs of a batch (``rows``, one per batch
        row) on a worker thread, for :meth:`select`'s ``prepared``; None when no row needs
        processing. No MLX call runs on the worker (:meth:`ProcessorInputs.host`), and
        llguidance fills the grammar masks with the GIL released, so the engine thread queues
        the step's forward pass meanwhile. The rows' parameters, ids and matchers must not
        change until :meth:`select` has taken the result."""
        if not any(s is not None and s.params.processed for s in rows):
            return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="stepserve-processors")
        return self._worker.submit(self.processor_inputs.host, rows, len(rows))

    def close(self) -> None:
        """Stop the worker thread (idle between steps; it is made again when needed)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def select(
        self,
        logits: mx.array,
        rows: list[Sequence | None],
        keys: list[mx.array | None],
        queued: bool = False,
        prepared: Future[HostInputs] | None = None,
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
        ``prepared``: :meth:`prepare`'s future for these rows (None: built here). Raises what
        building the inputs raised.
        """
        B = logits.shape[0]
        live = [s for s in rows if s is not None]
        raw = logits
        if any(s.params.processed for s in live):
            if not queued:
                mx.async_eval(logits)  # the forward pass runs while the host builds the processors' inputs
            if prepared is not None:
                inputs, masks, seconds = self.processor_inputs.to_device(prepared.result(), B)
            else:
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
