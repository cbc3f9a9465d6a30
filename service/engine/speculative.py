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

**The decision** (:meth:`Speculator.plan`). Let r be the batch bucket's cost ratio (verify step
/ plain step, measured at warm-up) and n the rows. A verify step takes r plain steps' time and
gives row i t_i tokens (1 + its accepted proposals), where plain steps give 1 per step; it pays
when ``sum(t_i) > n * r``. Each row carries its expected t (``RowState.tokens``), and a step
speculates when the rows' expected extra tokens, ``sum(t_i - 1)``, exceed ``n * (r - 1)``.

- Prompt lookup measures t without verifying: every step of a batch bucket that may speculate,
  it proposes up to K tokens for each row (plain Python, a few dictionary lookups), and once the
  row's own tokens have come, the proposal is scored by how many of them it guessed (for a
  greedy row exactly what a verify step would have accepted; for a sampled row, matching, the
  same in distribution). ``tokens`` averages 1 + matched over the row's proposals and starts at
  1: no verify step without evidence, and none needed to gather it.
- A draft's proposals cost draft steps, so a draft row's t comes from its verify steps: an
  average acceptance rate a, ``t = 1 + a + ... + a^k`` (Leviathan et al. 2023, eq. 1) with
  ``k = round(a / (1 - a)) + 1`` proposals (the run length a geometric acceptance of rate a
  makes likely), starting from ``PRIOR``. A draft row whose t fell too low is verified anyway
  after ``PROBE`` plain steps (doubling after each probe that did not pay, up to ``PROBE_MAX``),
  so that it can show it drafts well again; probes of a batch are at least
  ``(r - 1) / BUDGET`` plain steps apart (each costs the batch r - 1 plain steps).

**The cost bound.** A row's expectation counts toward a step only while its credit c is
non-negative: c starts at 0, gains ``BUDGET`` (0.02) per plain step and ``t - r`` per verify
step it counted toward (what that step gained or cost it, in plain-step times), gains what a
step it only rode along in gained it (never charged a cost), and is capped at K. It enters a
step it counts toward with c >= 0 and leaves with c >= 1 - r (t >= 1), so after S plain steps
the verify steps a row counted toward cost it, net of their tokens (and of what it gained riding
along), at most ``BUDGET * S + (r - 1)``: 2% of its plain-step time and one verify step's extra
cost, whatever its acceptance (alike when its average misleads: a middling, noisy acceptance
near r). A prompt-lookup row whose proposals are never accepted costs nothing: each scored
proposal gives t = 1, its expectation stays 1 token, and it never counts toward a verify step;
it only rides along in those the other rows' expected tokens pay for. The ratio is the
warm-up's, taken as what steps cost at run time (``service.engine.spec_warmup``).
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

PRIOR = 0.5  # a draft row's assumed acceptance rate before its first verify step
SMOOTHING = 0.3  # weight of the newest outcome in a row's averages
BUDGET = 0.02  # a row's credit per plain step: the share of its plain-step time verify steps may cost it
PROBE = 8  # plain steps a proposing draft row waits before it is verified anyway (to measure its acceptance)
PROBE_MAX = 256  # the longest wait: it doubles after each probe that did not pay


@dataclass
class RowState:
    """A row's record for the speculate-or-not decision (see the module docstring).

    Attributes:
        tokens: expected tokens a verify step gives the row (1 + accepted proposals); prompt
            lookup's average of its scored proposals, 1.0 before the first.
        rate: a draft row's average acceptance (accepted / proposed).
        k: a draft row's next proposal length.
        credit: plain-step times verify steps may still cost the row; its expectation counts
            only while it is >= 0.
        pending: prompt lookup's proposals not scored yet: (the row's length in tokens, prompt
            and output, when proposed; the proposed tokens).
        waited: plain steps since a draft row proposed without being verified.
        probe: a draft row's current wait before a probe.
    """

    tokens: float = 1.0
    rate: float = PRIOR
    k: int = 2
    credit: float = 0.0
    pending: list[tuple[int, list[int]]] = field(default_factory=list)
    waited: int = 0
    probe: int = PROBE


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
    _ratio: float = 1.0  # the ratio the latest plan was made with
    _counted: set[str] = field(default_factory=set)  # the rows whose expectation the latest plan counted
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
        if not live or not batch.has_cache:
            if isinstance(self.proposer, DraftProposer):
                self.proposer.kv = None  # the batch is empty: its draft cache goes too
            return None
        return self.plan_rows(live)

    def verify(self, batch: DecodeBatch, plan: dict[str, list[int] | int]) -> RunnerOutput:
        """Run one verify step of ``batch`` with :meth:`plan`'s proposals, read back; the rows'
        tokens in ``out.tokens``. Every token of the batch must be on the host (no plain step
        in flight)."""
        return self._step(batch, batch.live, plan)

    def plan_rows(self, live: list[Sequence]) -> dict[str, list[int] | int] | None:
        """:meth:`plan` for the rows ``live`` (the decision alone, no cache needed): each row's
        proposals (lookup: the tokens; draft: how many, by request id), or None: a plain step.
        A lookup row's earlier proposals are scored against the tokens it has now."""
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
        gain, probe, counted = 0.0, False, set()
        for seq in live:
            room = seq.params.max_tokens - len(seq.output_ids) - 1
            if _selects(seq) or room <= 0:
                continue
            state = self.rows.setdefault(seq.request_id, RowState(k=min(2, K)))
            if isinstance(self.proposer, PromptLookup):
                guess = self._lookup(seq, state, min(K, room))
                if not guess:
                    continue
                plan[seq.request_id], expected = guess, min(state.tokens - 1, len(guess))
            else:
                k = min(state.k, room)
                plan[seq.request_id], expected = k, sum(state.rate**i for i in range(1, k + 1))
                state.waited += 1
                probe = probe or (state.waited > state.probe and state.credit >= 0)
            if state.credit >= 0:
                gain += expected
                counted.add(seq.request_id)
        probe = probe and self.plain_steps * BUDGET >= ratio - 1  # a probe costs the whole batch r - 1 steps
        if plan and (self.forced or gain > max(len(live) * (ratio - 1), 0.0) or probe):
            self._ratio, self._counted = ratio, counted
            return plan
        self.plain_steps += 1
        for seq in live:
            if (state := self.rows.get(seq.request_id)) is not None:
                state.credit = min(state.credit + BUDGET, K)
        return None

    def verified(self, request_id: str, proposed: int, accepted: int) -> None:
        """Record a verify step's outcome for a row that proposed ``proposed`` tokens and had
        ``accepted`` of them accepted: its credit (charged when the plan counted its expectation,
        credited when the step gained it time) and, for a draft row, its acceptance average,
        next proposal length and probe wait (a probe that did not pay doubles the wait, up to
        ``PROBE_MAX`` steps). A prompt-lookup row's proposals are scored from its tokens
        (:meth:`plan`), whether verified or not."""
        state = self.rows.setdefault(request_id, RowState())
        paid = 1 + accepted - self._ratio  # plain-step times the step gained the row (negative: cost)
        if request_id in self._counted or paid > 0:  # (a row that rode along is charged nothing)
            state.credit = min(state.credit + paid, self.tokens)
        if isinstance(self.proposer, DraftProposer):
            state.rate = (1 - SMOOTHING) * state.rate + SMOOTHING * accepted / proposed
            run = state.rate / max(1 - state.rate, 1e-3)
            state.k = max(1, min(self.tokens, round(run) + 1))
            state.probe = PROBE if paid >= 0 else min(2 * state.probe, PROBE_MAX)
            state.waited = 0

    def _lookup(self, seq: Sequence, state: RowState, k: int) -> list[int]:
        """Score the row's earlier proposals that its tokens now decide (into ``state.tokens``),
        then propose up to ``k`` tokens (remembered, to be scored in turn)."""
        offset, out = len(seq.prompt_ids), seq.output_ids
        length = offset + len(out)
        waiting = []
        for at, guess in state.pending:
            came = out[at - offset : at - offset + len(guess)]
            matched = next((j for j, (a, b) in enumerate(zip(came, guess, strict=False)) if a != b), len(came))
            if matched < len(came) or len(came) == len(guess):  # a miss, or every guess came true
                state.tokens += SMOOTHING * (1 + matched - state.tokens)
            else:
                waiting.append((at, guess))
        assert isinstance(self.proposer, PromptLookup)
        guess = self.proposer.propose(seq.request_id, seq.prompt_ids, out, k)
        if guess:
            if waiting and waiting[-1][0] == length:  # planned again before a new token came
                waiting.pop()
            waiting.append((length, guess))
        state.pending = waiting[-2 * self.tokens :]
        return guess

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
        plan = self._reserve(batch, live, plan)
        rows, kv = list(batch.slots), batch.cache()
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
        logits, kv = ex.verify(kv, mx.concatenate([last[:, None], proposals], axis=1), positions)
        batch.keep_cache(kv)
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

    @staticmethod
    def _reserve(
        batch: DecodeBatch, live: list[Sequence], plan: dict[str, list[int] | int]
    ) -> dict[str, list[int] | int]:
        """``plan`` cut to the positions each row holds for its proposals (:meth:`DecodeBatch.reserve`:
        all of them in a static cache; a paged pool may give a row fewer, or none: it then rides
        along, its token the verify step's first)."""
        cut: dict[str, list[int] | int] = {}
        for seq in live:
            guess = plan.get(seq.request_id)
            if guess is None:
                continue
            k = guess if isinstance(guess, int) else len(guess)
            room = batch.reserve(seq, k)
            if room > 0:
                cut[seq.request_id] = guess[:room] if isinstance(guess, list) else room
        return cut

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
                self.verified(seq.request_id, k, counts[i] - 1)
                stat.proposed.append(k)
                stat.accepted.append(counts[i] - 1)
        lp = selected[2] if selected is not None else None
        for j in range(max(counts)):
            column = [s if s is not None and counts[i] > j else None for i, s in enumerate(rows)]
            observe(column, [e[j] if len(e) > j else 0 for e in emitted], lp if j == 0 else None)
        out.tokens += [(s, t) for s, e in zip(rows, emitted, strict=True) if s is not None for t in e]
        out.spec.append(stat)


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
