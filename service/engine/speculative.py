"""Speculative decoding inside the batched, compiled decode loop: several tokens per step for a
row whose continuation can be guessed, never slower for a batch where it cannot.

The engine asks :meth:`Speculator.plan` before each decode step. When the batch bucket was
found worth speculating at warm-up (``service.engine.spec_warmup``) and the rows' proposals
promise more tokens than the verify step costs, it runs one **verify step** instead of a decode
step: every row's newest token plus K proposed tokens at (batch, K + 1, capacity)
(``models.llama.verify``); rows without proposals ride along. Each row then emits its accepted
proposals and one more token (``models.speculative``), and its position moves by that many:
rejected proposals' keys and values are left past it, masked and later overwritten.

A verify step reads its tokens back before the next step (proposals need them on the host), so
it is not pipelined as plain decode steps are (a plain step still in flight is read back before
it); when no row proposes, the runner's own pipelined step runs, unchanged. Rows with a grammar,
penalties, a logit bias or logprobs do not propose (k = 0): their token comes from the
:meth:`TokenSelector.select` of plain steps on the verify step's first position, so they keep
exactly the tokens of plain decoding.

**Adaptivity.** Each row keeps an average of its acceptance (accepted / proposed); its next
proposal length is ``round(a / (1 - a)) + 1`` (capped at K), the run length a geometric
acceptance of rate ``a`` makes likely. A step speculates when the rows' expected tokens,
``sum(1 + a + ... + a^k)`` (Leviathan et al. 2023, eq. 1), beat one token per row times the
bucket's cost ratio (verify step / plain step, measured at warm-up), or when a row has proposed
for ``PROBE`` plain steps without being verified (a probe, so that a row whose average started
low can show that it copies); a probe that does not pay doubles that row's wait, and probes of a
batch of n rows are at least ``PROBE * n`` plain steps apart (each costs the whole batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from models import speculative
from models.speculative import take_prefix
from service.engine.batch import DecodeBatch
from service.engine.buckets import BucketTable
from service.engine.compile_cache import StepSpec
from service.engine.draft import DraftProposer
from service.engine.executor import Executor
from service.engine.lookup import PromptLookup
from service.engine.outputs import RunnerOutput
from service.engine.selector import TokenSelector, observe
from service.engine.sequence import Sequence
from service.metrics import SpecStat, StepStat

PRIOR = 0.5  # a new row's assumed acceptance rate
SMOOTHING = 0.3  # weight of the newest step in a row's acceptance average
PROBE = 8  # plain steps a proposing row waits before it is verified anyway (to measure its acceptance)
PROBE_MAX = 256  # the longest wait: it doubles after each probe that did not pay


@dataclass
class RowState:
    """A row's recent acceptance (exponential average) and its next proposal length."""

    rate: float = PRIOR
    k: int = 2
    waited: int = 0  # plain steps since it proposed without being verified
    probe: int = PROBE  # its current wait before a probe


@dataclass
class Speculator:
    """Speculative decoding for one model's decode batch.

    Attributes:
        proposer: :class:`PromptLookup` or :class:`DraftProposer`.
        executor: where the verify steps run (the engine's; the speculator registers its steps on it).
        selector: picks the tokens of rows that do not propose (the engine's).
        buckets: the bucket table.
        tokens: K, proposals per row at most (the verify step's width is K + 1).
        ratios: batch bucket -> (verify step seconds / plain step seconds), the buckets that may
            speculate (filled by the warm-up's calibration; forced ones hold 1.0).
        max_batch: None: calibrate at warm-up; else speculate in batch buckets up to this one
            without measuring.
        forced: speculate whenever a row proposes (the warm-up rehearsal sets it).
    """

    proposer: PromptLookup | DraftProposer
    executor: Executor
    selector: TokenSelector
    buckets: BucketTable
    tokens: int = 4
    max_batch: int | None = None
    ratios: dict[int, float] = field(default_factory=dict)
    calibration: dict[str, dict] = field(default_factory=dict)
    forced: bool = False
    rows: dict[str, RowState] = field(default_factory=dict)
    plain_steps: int = 0  # plain steps since the last verify step (probes are spaced by them)
    _zeros: dict[int, mx.array] = field(default_factory=dict, repr=False)

    @property
    def method(self) -> str:
        return self.proposer.method

    def __post_init__(self) -> None:
        self.executor.register("spec_keys", StepSpec(speculative.spec_keys, random_state=True))
        self.executor.register("spec_accept", StepSpec(speculative.spec_accept))

    def describe(self) -> dict:
        """What ``/readyz`` shows: the method, K and the calibration per batch bucket."""
        return {"method": self.method, "tokens": self.tokens, "batches": self.calibration}

    # -- one decode step ------------------------------------------------------------------

    def plan(self, batch: DecodeBatch) -> dict[str, list[int] | int] | None:
        """Whether ``batch``'s next step is a verify step (see the module docstring): each row's
        proposals (lookup: the tokens; draft: how many, by request id), or None (a plain step).
        The engine reads back a plain step still in flight before it runs :meth:`verify`."""
        live = batch.live
        if not live or batch.kv is None:
            if isinstance(self.proposer, DraftProposer):
                self.proposer.kv = None  # the batch is empty: its draft cache goes too
            return None
        return self._plan(live)

    def verify(self, batch: DecodeBatch, plan: dict[str, list[int] | int]) -> RunnerOutput:
        """Run one verify step of ``batch`` with :meth:`plan`'s proposals, read back; the rows'
        tokens in ``out.tokens``. Every token of the batch must be on the host (no plain step
        in flight)."""
        return self._step(batch, batch.live, plan)

    def _plan(self, live: list[Sequence]) -> dict[str, list[int] | int] | None:
        """Each row's proposals (lookup: the tokens; draft: how many), or None: do not speculate."""
        B = self.buckets.batch_for(len(live))
        ratio = self.ratios.get(B)  # None: a bucket the warm-up did not find worth it (or did not warm)
        unwarmed = not self.calibration and self.max_batch is not None and B <= self.max_batch  # (tests)
        if ratio is not None and (self.forced or self.max_batch is not None) or unwarmed:
            ratio = 1.0
        K = self.tokens
        if ratio is None or max(s.position for s in live) + K + 1 > self.buckets.capacity[-1]:
            return None
        self._forget(live)
        plan: dict[str, list[int] | int] = {}
        gain, probe = 0.0, False
        for seq in live:
            p = seq.params
            room = p.max_tokens - len(seq.output_ids) - 1
            if _selects(seq) or room <= 0:
                continue
            state = self.rows.setdefault(seq.request_id, RowState(k=min(2, K)))
            k = min(state.k, room)
            if isinstance(self.proposer, PromptLookup):
                guess = self.proposer.propose(seq.request_id, seq.prompt_ids + seq.output_ids, k)
                if not guess:
                    continue
                plan[seq.request_id], k = guess, len(guess)
            else:
                plan[seq.request_id] = k
            gain += sum(state.rate**i for i in range(1, k + 1))
            state.waited += 1
            probe = probe or state.waited > state.probe
        probe = probe and self.plain_steps >= PROBE * len(live)  # a probe costs the whole batch a verify step
        if not plan or (len(live) + gain < len(live) * ratio and not probe):
            self.plain_steps += 1
            return None
        return plan

    def _forget(self, live: list[Sequence]) -> None:
        keep = {s.request_id for s in live}
        self.rows = {r: s for r, s in self.rows.items() if r in keep}
        if isinstance(self.proposer, PromptLookup):
            self.proposer.forget(keep)

    def _step(self, batch: DecodeBatch, live: list[Sequence], plan: dict[str, list[int] | int]) -> RunnerOutput:
        """One verify step of the whole batch, read back; the rows' tokens in ``out.tokens``."""
        out, start, K = RunnerOutput(), time.perf_counter(), self.tokens
        ex = self.executor
        self.plain_steps = 0
        W = K + 1
        out.moves += batch.refit(live, extra=K)
        rows, kv = list(batch.slots), batch.kv
        assert kv is not None
        B, C = kv.batch, kv.capacity
        keys = [batch.key_of(s) for s in rows]
        greedy = all(s.params.temperature == 0 for s in live)
        sampling = _sampling_arrays(rows, ex.vocab)
        if greedy:
            noise = extra = chain = None
        else:
            key_rows = mx.stack([k if k is not None else mx.zeros((2,), mx.uint32) for k in keys])
            seeded = mx.array([k is not None for k in keys])
            noise, chain, extra = ex.step_fn("spec_keys", B, W)(key_rows, seeded, mx.zeros((W,), mx.int32))
        fed: list[int] = [0] * B
        if isinstance(self.proposer, DraftProposer):
            proposals, q, fed = self._draft(rows, B, C, W, noise, sampling, greedy)
        else:
            host = [(plan.get(s.request_id) or []) if s else [] for s in rows]
            proposals = mx.array([list(g) + [0] * (K - len(g)) for g in host], mx.int32)  # type: ignore[arg-type]
            q = None if greedy else self._no_draft(B, ex.vocab)
        last = mx.array([s.last_token if s else 0 for s in rows], mx.int32)
        positions = [s.position if s else 0 for s in rows]
        logits, batch.kv = ex.step_fn("verify", B, W, C)(
            ex.model.params, mx.concatenate([last[:, None], proposals], axis=1), mx.array(positions, mx.int32), kv
        )
        if greedy:
            y, accept, residual = ex.step_fn("greedy")(logits.reshape(B * W, -1)).reshape(B, W), None, None
        else:
            y, accept, residual = ex.step_fn("spec_accept", B, W)(logits, proposals, q, *sampling, noise, extra)
        own = [s if s is not None and s.request_id not in plan and _selects(s) else None for s in rows]
        selected = self.selector.select(logits[:, 0], own, keys) if any(own) else None
        mx.eval(y, proposals, *([accept, residual] if accept is not None else []), *(selected[0:1] if selected else []))
        emitted = self._emitted(rows, plan, y, proposals, accept, residual, selected)
        self._advance(batch, rows, emitted, keys, chain, selected, fed, plan, out)
        seconds = time.perf_counter() - start
        out.steps.append(StepStat(ex.model.name, "verify", f"b{B}x{W}c{C}", len(live), B, seconds))
        return out

    def _no_draft(self, B: int, vocab: int) -> mx.array:
        """float32 [B, K, V] zeros: spec_accept's draft distributions when there is no draft
        (prompt lookup rows accept by matching); made once per batch bucket."""
        if B not in self._zeros:
            self._zeros[B] = mx.zeros((B, self.tokens, vocab))
            mx.eval(self._zeros[B])
        return self._zeros[B]

    def _draft(self, rows, B, C, W, noise, sampling, greedy):
        """The draft's proposals for ``rows`` (its cache mirrored to the target's (B, C) first,
        rows that fell behind recomputed): see :meth:`DraftProposer.propose`."""
        proposer = self.proposer
        assert isinstance(proposer, DraftProposer)
        proposer.mirror(rows, B, C)
        for seq in rows:
            if seq is not None:
                proposer.catch_up(seq)
        if noise is None:
            noise = mx.zeros((B, W, 2), mx.uint32)
        return proposer.propose(rows, W - 1, noise, sampling, greedy)

    def _emitted(self, rows, plan, y, proposals, accept, residual, selected) -> list[list[int]]:
        """Each row's tokens from this step (host lists; [] for empty slots)."""
        y_l, p_l = y.tolist(), proposals.tolist()
        a_l = accept.tolist() if accept is not None else None
        r_l = residual.tolist() if residual is not None else None
        sel = selected[0].tolist() if selected is not None else None
        out: list[list[int]] = []
        for i, seq in enumerate(rows):
            if seq is None:
                out.append([])
                continue
            guess = plan.get(seq.request_id)
            if guess is None:
                out.append([int(sel[i]) if _selects(seq) and sel is not None else int(y_l[i][0])])
                continue
            k = guess if isinstance(guess, int) else len(guess)
            rejection = (
                a_l is not None
                and isinstance(self.proposer, DraftProposer)
                and seq.params.temperature > 0
                and seq.params.seed is None
            )
            if rejection:
                out.append(take_prefix(y_l[i], p_l[i], k, a_l[i], r_l[i]))  # type: ignore[index]
            else:
                out.append(take_prefix(y_l[i], p_l[i], k))
        return out

    def _advance(self, batch: DecodeBatch, rows, emitted, keys, chain, selected, fed, plan, out: RunnerOutput) -> None:
        """Move every row past its emitted tokens: positions, keys, the draft's cache, the
        host-side state (:func:`~service.engine.selector.observe`), adaptivity, and the tokens for the engine."""
        counts = [len(e) for e in emitted]
        if chain is not None:
            index = mx.array([max(c, 1) for c in counts], mx.int32)[:, None, None]
            next_chain = mx.take_along_axis(chain, index, axis=1)[:, 0]
        stat = SpecStat(self.executor.model.name, self.method)
        for i, seq in enumerate(rows):
            if seq is None:
                continue
            guess = plan.get(seq.request_id)
            own = selected is not None and guess is None and _selects(seq)
            if keys[i] is not None and (own or chain is not None):  # (a greedy batch keeps its keys)
                batch.keep_key(seq, selected[1][i] if own else next_chain[i])  # type: ignore[index]
            if isinstance(self.proposer, DraftProposer):
                self.proposer.accepted(seq, seq.position, counts[i] - 1, fed[i])
            seq.position += counts[i]
            stat.tokens_per_row.append(counts[i])
            if guess is not None:
                k = guess if isinstance(guess, int) else len(guess)
                self._adapt(seq.request_id, k, counts[i] - 1)
                stat.proposed.append(k)
                stat.accepted.append(counts[i] - 1)
        lp = selected[2] if selected is not None else None
        for j in range(max(counts)):
            column = [s if s is not None and counts[i] > j else None for i, s in enumerate(rows)]
            observe(column, [e[j] if len(e) > j else 0 for e in emitted], lp if j == 0 else None)
        out.tokens += [(s, t) for s, e in zip(rows, emitted, strict=True) if s is not None for t in e]
        out.spec.append(stat)

    def _adapt(self, request_id: str, proposed: int, accepted: int) -> None:
        """Update a verified row's acceptance average and next proposal length; a probe that
        did not pay doubles the row's wait before the next (up to ``PROBE_MAX`` steps)."""
        state = self.rows.setdefault(request_id, RowState())
        state.rate = (1 - SMOOTHING) * state.rate + SMOOTHING * accepted / proposed
        run = state.rate / max(1 - state.rate, 1e-3)
        state.k = max(1, min(self.tokens, round(run) + 1))
        state.probe = PROBE if accepted * 2 >= proposed else min(2 * state.probe, PROBE_MAX)
        state.waited = 0


def _selects(seq: Sequence) -> bool:
    """The row's token comes from :meth:`TokenSelector.select` (logits processors, logprobs)."""
    return seq.params.processed or seq.params.logprobs is not None


def _sampling_arrays(rows: list[Sequence | None], vocab: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(temperature, top_p, top_k, min_p), each [B]: the rows' parameters (empty rows greedy)."""
    temperature = mx.array([s.params.temperature if s else 0.0 for s in rows], mx.float32)
    top_p = mx.array([s.params.top_p if s else 1.0 for s in rows], mx.float32)
    top_k = mx.array([min(s.params.top_k or vocab, vocab) if s else vocab for s in rows], mx.int32)
    min_p = mx.array([s.params.min_p if s else 0.0 for s in rows], mx.float32)
    return temperature, top_p, top_k, min_p
