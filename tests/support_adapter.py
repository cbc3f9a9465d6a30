"""The adapter's parity check: an mlx-lm module run batched through :mod:`models.adapter`'s
compiled steps against each row run alone with mlx-lm's own caches.

:func:`check_parity` is what a test calls per tiny config (here a handful, the parity matrix
every architecture): rows of different lengths right-padded to one prompt bucket, prefill, the
rows inserted into a decode cache with an empty slot, decode steps, a bucket move (capacity
grown, rows reordered), then the same prompts in two chunks and, where the model can verify,
every decode step at once; where the paged KV pool holds the model, every decode step at once
over the pool too (``verify_paged``: sliding-window layers included). Each phase's logits are
compared with the reference's, and the greedy tokens with the reference's greedy continuation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from models.adapter import AdapterArgs, decode, prefill, prefill_chunk, verify, verify_paged
from models.kv_cache import KVCache
from models.paged import PagedKV, write


@dataclass
class ParityReport:
    """What :func:`check_parity` found for one model.

    Attributes:
        model_type: the module's ``model_type``.
        diffs: phase -> max |Δ logits| against the reference, float32 (phases: prefill,
            decode (before and after the bucket move), chunk, chunk-decode, verify,
            verify-paged).
        token_mismatches: phases whose greedy tokens differ from the reference's.
        tolerance: the largest |Δ logits| :attr:`ok` accepts.
        error: the exception a step raised, as "Type: message", or None.
        notes: what was left out and why (e.g. verify for a model with rings or states).
    """

    model_type: str
    diffs: dict[str, float] = field(default_factory=dict)
    token_mismatches: list[str] = field(default_factory=list)
    tolerance: float = 1e-4
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No error, every phase within tolerance and every greedy token identical."""
        return (
            self.error is None
            and bool(self.diffs)
            and all(d <= self.tolerance for d in self.diffs.values())
            and not self.token_mismatches
        )

    def __str__(self) -> str:
        phases = " ".join(f"{k}={v:.1e}" for k, v in self.diffs.items())
        verdict = "ok" if self.ok else "FAIL"
        extra = f" tokens differ in {self.token_mismatches}" if self.token_mismatches else ""
        error = f" error {self.error}" if self.error else ""
        return f"{self.model_type}: {verdict} {phases}{extra}{error}"


@dataclass
class _Reference:
    """Row b alone with mlx-lm's own caches: its prefill logits [V], its greedy tokens (one
    per decode step) and each step's logits [V]."""

    prefill: list[mx.array]
    tokens: list[list[int]]
    decode: list[list[mx.array]]


def check_parity(
    model: nn.Module,
    lengths: tuple[int, ...] = (5, 11),
    steps: int = 3,
    tolerance: float = 1e-4,
    seed: int = 0,
    shift: int = 0,
) -> ParityReport:
    """Run ``model`` batched through the adapter's compiled steps and compare with each row
    run alone through mlx-lm's own caches (float32 on the current device).

    Args:
        model: an mlx-lm ``Model`` whose parameters are evaluated.
        lengths: the prompt rows' lengths (where the model's recurrent layers ignore padding,
            ``AdapterArgs.pads_prompts`` False, every row takes the longest).
        steps: decode steps (>= 2: the bucket move falls after the first).
        tolerance: the largest |Δ logits| accepted.
        seed: the random prompts' seed.
        shift: added to every decode position (a control: nonzero must fail).

    Returns:
        The :class:`ParityReport`; an exception in any step is recorded in ``error``.
    """
    report = ParityReport(str(getattr(model, "model_type", type(model).__module__)), tolerance=tolerance)
    try:
        args = AdapterArgs.from_module(model)
        report.model_type = args.model_type
        if not args.pads_prompts:
            lengths = (max(lengths),) * len(lengths)
            report.notes.append("rows of equal length: its recurrent layers ignore padding")
        mx.random.seed(seed)
        prompts = [[_int(t) for t in mx.random.randint(0, args.vocab_size, (n,))] for n in lengths]
        ref = _reference(model, prompts, steps)
        _batched(args, prompts, ref, report, shift)
        _chunked(args, prompts, ref, report)
        if args.can_verify:
            _verified(args, prompts, ref, report)
        else:
            report.notes.append("no verify: the model has sliding-window rings or recurrent states")
        if args.prefix_blocks and not args.capacity_pair:
            _verified_paged(args, prompts, ref, report)
        else:
            report.notes.append("no paged verify: the pool cannot hold its caches")
    except Exception as e:  # noqa: BLE001 - the report names whatever a model raised
        report.error = f"{type(e).__name__}: {e}"
    return report


def _reference(model: nn.Module, prompts: list[list[int]], steps: int) -> _Reference:
    """Each prompt alone through ``make_prompt_cache(model)``, then ``steps`` greedy tokens."""
    ref = _Reference([], [], [])
    for prompt in prompts:
        cache = make_prompt_cache(model)
        logits = model(mx.array([prompt], mx.int32), cache=cache)[0, -1].astype(mx.float32)
        ref.prefill.append(logits)
        tokens, outs = [], []
        for _ in range(steps):
            tokens.append(_greedy(logits))
            logits = model(mx.array([[tokens[-1]]], mx.int32), cache=cache)[0, -1].astype(mx.float32)
            outs.append(logits)
        ref.tokens.append(tokens)
        ref.decode.append(outs)
        mx.eval(ref.prefill, outs)
    return ref


def _compare(report: ParityReport, phase: str, got: list[mx.array], want: list[mx.array], tokens: list[int]) -> None:
    """Record max |got - want| under ``phase`` and whether argmax(got) equals ``tokens``."""
    diff = max(_float(mx.abs(g - w).max()) for g, w in zip(got, want, strict=True))
    report.diffs[phase] = max(report.diffs.get(phase, 0.0), diff if math.isfinite(diff) else math.inf)
    if [_greedy(g) for g in got] != tokens and phase not in report.token_mismatches:
        report.token_mismatches.append(phase)


def _padded(prompts: list[list[int]], T: int) -> mx.array:
    """int32 [B, T]: the prompts right-padded with token 0."""
    return mx.array([p + [0] * (T - len(p)) for p in prompts], mx.int32)


def _batched(args: AdapterArgs, prompts: list[list[int]], ref: _Reference, report: ParityReport, shift: int) -> None:
    """Prefill at a bucket one longer than the longest prompt (where padding is allowed),
    insert into a decode cache of B + 1 rows, decode, grow the capacity and reverse the rows,
    decode on. Compared: prefill logits, every decode step's logits and greedy tokens."""
    params, B = args.module.parameters(), len(prompts)
    lengths = [len(p) for p in prompts]
    T = max(lengths) + (1 if args.pads_prompts else 0)
    run_prefill, run_decode = (mx.compile(partial(f, args=args)) for f in (prefill, decode))
    logits, staged = run_prefill(
        params, _padded(prompts, T), mx.array(lengths, mx.int32), args.allocate(B, T, mx.float32)
    )
    _compare(report, "prefill", [logits[b] for b in range(B)], ref.prefill, [_greedy(r) for r in ref.prefill])
    kv = args.allocate(B + 1, max(lengths) + 1, mx.float32, ring=True)  # slot B stays empty
    kv.insert_rows(list(range(B)), staged, list(range(B)), lengths)
    rows, positions = list(range(B + 1)), [*lengths, 0]
    for step in range(len(ref.tokens[0])):
        if step == 1:  # the bucket move: a larger capacity, the rows in another order
            kv = kv.resized(max(lengths) + len(ref.tokens[0]) + 2, args.windows).reordered(rows[::-1])
            rows, positions = rows[::-1], positions[::-1]
        tokens = [ref.tokens[r][step] if r < B else 0 for r in rows]
        at = mx.array([p + shift for p in positions], mx.int32)
        logits, kv = run_decode(params, mx.array(tokens, mx.int32), at, kv)
        live = [i for i, r in enumerate(rows) if r < B]
        want = [ref.decode[rows[i]][step] for i in live]
        got = [logits[i] for i in live]
        _compare(report, "decode" if step == 0 else "decode-moved", got, want, [_greedy(w) for w in want])
        positions = [p + 1 if r < B else 0 for p, r in zip(positions, rows, strict=True)]


def _greedy(logits: mx.array) -> int:
    """argmax of logits [V]."""
    return _int(mx.argmax(logits))


def _int(x: mx.array) -> int:
    """A scalar array's value as an int."""
    return int(cast(int, x.item()))


def _float(x: mx.array) -> float:
    """A scalar array's value as a float."""
    return float(cast(float, x.item()))


def _chunked(args: AdapterArgs, prompts: list[list[int]], ref: _Reference, report: ParityReport) -> None:
    """Each prompt in two chunks on one batched staging cache (right-padded to the chunk
    bucket where padding is allowed), then one decode step from there. Compared: the second
    chunk's logits with the reference prefill's, the decode step's with the reference's."""
    params, B = args.module.parameters(), len(prompts)
    lengths = [len(p) for p in prompts]
    firsts = [max(1, n // 2) for n in lengths]
    seconds = [n - f for n, f in zip(lengths, firsts, strict=True)]
    pad = 1 if args.pads_prompts else 0
    T1, T2 = max(firsts) + pad, max(seconds) + pad
    capacity = max(firsts) + T2 + 1
    run_chunk, run_decode = (mx.compile(partial(f, args=args)) for f in (prefill_chunk, decode))
    kv = args.allocate(B, capacity, mx.float32)
    _, kv = run_chunk(
        params,
        _padded([p[:f] for p, f in zip(prompts, firsts, strict=True)], T1),
        mx.zeros((B,), mx.int32),
        mx.array(firsts, mx.int32),
        kv,
    )
    logits, kv = run_chunk(
        params,
        _padded([p[f:] for p, f in zip(prompts, firsts, strict=True)], T2),
        mx.array(firsts, mx.int32),
        mx.array(seconds, mx.int32),
        kv,
    )
    _compare(report, "chunk", [logits[b] for b in range(B)], ref.prefill, [_greedy(r) for r in ref.prefill])
    decode_kv = args.allocate(B, capacity, mx.float32, ring=True)
    decode_kv.insert_rows(list(range(B)), kv, list(range(B)), lengths)
    tokens = mx.array([t[0] for t in ref.tokens], mx.int32)
    logits, _ = run_decode(params, tokens, mx.array(lengths, mx.int32), decode_kv)
    want = [d[0] for d in ref.decode]
    _compare(report, "chunk-decode", [logits[b] for b in range(B)], want, [_greedy(w) for w in want])


def _verified(args: AdapterArgs, prompts: list[list[int]], ref: _Reference, report: ParityReport) -> None:
    """Prefill, then every reference decode token in one verify step: entry j must equal
    the reference's decode step j."""
    params, B = args.module.parameters(), len(prompts)
    lengths = [len(p) for p in prompts]
    K1 = len(ref.tokens[0])
    T = max(lengths) + 1
    run_prefill, run_verify = (mx.compile(partial(f, args=args)) for f in (prefill, verify))
    _, staged = run_prefill(params, _padded(prompts, T), mx.array(lengths, mx.int32), args.allocate(B, T, mx.float32))
    kv: KVCache = args.allocate(B, T + K1, mx.float32, ring=True)
    kv.insert_rows(list(range(B)), staged, list(range(B)), lengths)
    logits, _ = run_verify(params, mx.array(ref.tokens, mx.int32), mx.array(lengths, mx.int32), kv)
    got = [logits[b, j] for b in range(B) for j in range(K1)]
    want = [ref.decode[b][j] for b in range(B) for j in range(K1)]
    _compare(report, "verify", got, want, [_greedy(w) for w in want])


def _verified_paged(args: AdapterArgs, prompts: list[list[int]], ref: _Reference, report: ParityReport) -> None:
    """Prefill, write each row into a paged pool of noise through a table of blocks in
    descending order (4 positions each, then a null column), then every reference decode token
    in one ``verify_paged`` step over the pool: entry j must equal mlx-lm's own forward over the
    prompt and the first j + 1 tokens, prefilled at once (a sliding layer's window is a mask on
    the row's linear view, slid past where the prompt is longer than the window). That is the
    reference decode step j wherever mlx-lm's decode agrees with its prefill; plamo3's does not
    (its prefill masks W + 1 keys, its ring keeps W: tests/parity/tiny_configs.py QUIRKS), and a
    several-token step on the pool masks as its prefill does."""
    params, B = args.module.parameters(), len(prompts)
    lengths = [len(p) for p in prompts]
    K1, bt = len(ref.tokens[0]), 4
    T = max(lengths) + 1
    M = -(-(max(lengths) + K1) // bt) + 1  # one null column past the longest row's blocks
    run_prefill, run_verify = (mx.compile(partial(f, args=args)) for f in (prefill, verify_paged))
    _, staged = run_prefill(params, _padded(prompts, T), mx.array(lengths, mx.int32), args.allocate(B, T, mx.float32))
    N = 1 + B * (M - 1)
    order = list(range(N - 1, 0, -1))  # every row's positions run backwards through the pool
    table = mx.array([order[b * (M - 1) : (b + 1) * (M - 1)] + [0] for b in range(B)], mx.int32)
    mx.random.seed(1)
    kv = args.kv_layouts[0]
    shape = (N, kv.heads, bt, kv.key_dim)
    pool = PagedKV(
        [mx.random.normal(shape) for _ in args.kv_layouts], [mx.random.normal(shape) for _ in args.kv_layouts]
    )
    for b, n in enumerate(lengths):
        at = mx.arange(n, dtype=mx.int32)[None]
        for layer in range(len(args.kv_layouts)):
            pool.keys[layer] = write(pool.keys[layer], table[b : b + 1], at, staged.keys[layer][b : b + 1, :, :n])
            pool.values[layer] = write(pool.values[layer], table[b : b + 1], at, staged.values[layer][b : b + 1, :, :n])
    logits, _ = run_verify(params, mx.array(ref.tokens, mx.int32), mx.array(lengths, mx.int32), table, pool)
    got = [logits[b, j] for b in range(B) for j in range(K1)]
    want = [_prefilled(args.module, prompts[b] + ref.tokens[b][: j + 1]) for b in range(B) for j in range(K1)]
    _compare(report, "verify-paged", got, want, [_greedy(w) for w in want])


def _prefilled(model: nn.Module, ids: list[int]) -> mx.array:
    """mlx-lm's float32 logits [V] after ``ids``, prefilled at once through its own caches."""
    return model(mx.array([ids], mx.int32), cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
