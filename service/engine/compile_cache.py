"""The compile cache: the only place stepserve calls ``mx.compile``.

One compiled function per :class:`StepKey` (model, phase, batch bucket, prompt or capacity
bucket, dtype). Every lookup counts a hit or a miss; the first call of a new entry is timed
(``mx.compile`` is lazy: tracing and kernel building happen on that call) and reported as
its compile time. The policy decides what runs:

* ``on``: the compiled function;
* ``off``: the same function eagerly, so ``--compile off`` is the exact eager baseline;
* ``auto``: whichever of the two :meth:`CompileCache.calibrate` measured faster for that key
  at warm-up (compiled must win by ``AUTO_MARGIN``; ties go to eager). Uncalibrated keys run
  compiled.

A :class:`StepSpec` marked ``eager`` runs eagerly under every policy (a step its model is known
to run slower compiled: :attr:`models.adapter.args.AdapterArgs.loops_prompts`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx

from service.metrics import CompileStat

log = logging.getLogger("stepserve.compile")
AUTO_MARGIN = 0.02  # compiled must be >= 2% faster than eager for ``auto`` to keep it
Policy = str  # "on" | "off" | "auto"


@dataclass(frozen=True)
class StepKey:
    """What a compiled function is specialised to.

    Attributes:
        model: the model's name.
        phase: "prefill", "chunk", "decode", "sample" or "greedy".
        batch: batch bucket B (0 for shapeless functions).
        size: prompt bucket T (prefill, chunk) or capacity bucket C (decode); 0 where none applies.
        dtype: compute dtype name.
        capacity: the cache's capacity bucket C of a prefill chunk; 0 elsewhere.
    """

    model: str
    phase: str
    batch: int
    size: int
    dtype: str
    capacity: int = 0

    @property
    def bucket(self) -> str:
        """Label value: ``b{B}``, ``b{B}x{T|C}`` or ``b{B}x{T}c{C}``; ``any`` for shapeless functions."""
        if self.batch == 0:
            return "any"
        return (
            f"b{self.batch}" + (f"x{self.size}" if self.size else "") + (f"c{self.capacity}" if self.capacity else "")
        )


@dataclass(frozen=True)
class StepSpec:
    """How to compile one phase: the pure function and its compile options.

    Attributes:
        fn: the pure step function (hyper-parameters already bound).
        shapeless: compile once for all shapes (only where a test proves it safe).
        random_state: capture ``mx.random.state`` as compile input and output.
        eager: never compiled, whatever the policy (the entry reports it runs eager).
    """

    fn: Callable[..., Any]
    shapeless: bool = False
    random_state: bool = False
    eager: bool = False


class _Entry:
    """A step function whose first call is timed and reported; under ``auto`` it holds the
    compiled and the eager form and runs the one chosen."""

    def __init__(
        self,
        key: StepKey,
        fn: Callable[..., Any],
        eager: Callable[..., Any],
        on_compiled: Callable[[CompileStat], None],
    ):
        self.key, self._compiled, self._eager, self._on_compiled = key, fn, eager, on_compiled
        self._fn = fn
        self.compile_seconds: float | None = None
        self.timings: tuple[float, float] | None = None  # (compiled, eager) seconds, when calibrated

    @property
    def compiled(self) -> bool:
        """Whether calls run the compiled function."""
        return self._fn is not self._eager

    def calibrate(self, args: tuple, repeats: int) -> bool:
        """Time the compiled and the eager form on ``args`` (median of ``repeats`` runs after
        one untimed call each) and keep the faster; returns whether compiled was kept. An eager
        spec's entry (:attr:`StepSpec.eager`) only runs once and stays eager."""
        return self._calibrate(
            lambda: mx.eval(self(*args)),
            lambda fn: mx.eval(fn(*args)),
            lambda fn: median_seconds(fn, args, repeats),
        )

    def calibrate_pooled(self, head: tuple, pool: list, repeats: int) -> bool:
        """:meth:`calibrate` for a step whose last argument is a KV pool it writes and returns
        as its second output (a paged step): ``head`` the other arguments, ``pool`` a one-item
        list holding the pool, which each call takes out and replaces with the pool it returns.
        The caller drops its own references first, as for :meth:`call_owning`: each evaluation
        then writes the pool in place instead of copying it (every layer) once per call."""

        def first() -> None:
            out = self.call_owning([*head, pool.pop()])
            mx.eval(out)  # before the pool is kept again: only the output holds it meanwhile
            pool.append(out[1])

        def run(fn: Callable[..., Any]) -> None:
            call = (*head, pool.pop())
            out = fn(*call)
            del call
            mx.eval(out)
            pool.append(out[1])

        return self._calibrate(first, run, lambda fn: median_wall(lambda: run(fn), repeats))

    def _calibrate(
        self,
        first: Callable[[], None],
        run: Callable[[Callable[..., Any]], None],
        timed: Callable[[Callable[..., Any]], float],
    ) -> bool:
        """The calibration of :meth:`calibrate` and :meth:`calibrate_pooled`: ``first`` makes
        the entry's first call (the compile, timed and reported), ``run(fn)`` runs and evaluates
        ``fn`` once on the arguments, and ``timed(fn)`` is its median seconds."""
        if self._compiled is self._eager:  # an eager spec (StepSpec.eager): nothing to compare
            first()
            return False
        self._fn = self._compiled
        first()  # the compile
        run(self._eager)
        compiled, eager = timed(self._compiled), timed(self._eager)
        self.timings = (compiled, eager)
        self._fn = self._compiled if compiled < eager * (1 - AUTO_MARGIN) else self._eager
        return self.compiled

    def __call__(self, *args):
        if self.compile_seconds is not None:
            return self._fn(*args)
        return self.call_owning(list(args))

    def call_owning(self, args: list) -> Any:
        """:meth:`__call__` on the arguments in ``args``, which this call empties before the
        first call's evaluation (the compile, timed and reported). MLX updates an input in place
        only when nothing else holds it: a paged step's scatters into the KV pool would copy the
        whole pool (every layer) if the caller still held it while that evaluation ran. A
        caller that drops its own references first (:meth:`Executor.warm`) gets the in-place
        write; one that keeps them gets a copy, as with :meth:`__call__`."""
        call, start = tuple(args), time.perf_counter()
        args.clear()
        out = self._fn(*call)
        if self.compile_seconds is not None:
            return out
        del call
        mx.eval(out)
        self.compile_seconds = time.perf_counter() - start
        self._on_compiled(CompileStat(self.key.model, self.key.phase, self.key.bucket, self.compile_seconds))
        return out


def median_seconds(fn: Callable[..., Any], args: tuple, repeats: int) -> float:
    """Median wall seconds of ``mx.eval(fn(*args))`` over ``repeats`` runs (no warm-up run)."""
    return median_wall(lambda: mx.eval(fn(*args)), repeats)


def median_wall(call: Callable[[], None], repeats: int) -> float:
    """Median wall seconds of ``call()`` over ``repeats`` runs (no warm-up run)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


class CompileCache:
    """Step functions keyed by bucket, compiled according to the policy.

    Args:
        policy: "on", "off" or "auto" (see the module docstring); a bool means on/off.
        on_lookup: called with (model, phase, bucket, hit) for every lookup.
        on_compiled: called with a :class:`CompileStat` after each entry's first call.
    """

    def __init__(
        self,
        policy: Policy | bool,
        on_lookup: Callable[[str, str, str, bool], None],
        on_compiled: Callable[[CompileStat], None],
    ):
        self.policy: Policy = ("on" if policy else "off") if isinstance(policy, bool) else policy
        self.enabled = self.policy != "off"
        self._on_lookup, self._on_compiled = on_lookup, on_compiled
        self._entries: dict[StepKey, _Entry] = {}
        self._lock = threading.Lock()
        self._sealed = False

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: StepKey, spec: StepSpec) -> Callable[..., Any]:
        """The function for ``key``, compiling ``spec`` on the first lookup (a miss).

        After :meth:`seal` a miss does not compile: the bucket runs eagerly (the same pure
        function), so no request waits for a compile, and a warning names the bucket.
        """
        with self._lock:
            entry = self._entries.get(key)
            hit = entry is not None
            if entry is None:
                fn = spec.fn if self._sealed else self._build(spec)
                entry = _Entry(key, fn, spec.fn, self._on_compiled)
                if self._sealed:
                    entry.compile_seconds = 0.0  # nothing compiles: no compile time to report
                self._entries[key] = entry
        self._on_lookup(key.model, key.phase, key.bucket, hit)
        if not hit and self._sealed:
            log.warning(
                "%s %s %s was not warmed up: it runs eagerly (widen the warm-up to compile it)",
                key.model,
                key.phase,
                key.bucket,
            )
        return entry

    def seal(self) -> None:
        """Warm-up is over: from now on a miss runs its bucket eagerly rather than make a
        request wait for a compile, with a warning naming the bucket."""
        self._sealed = True

    def choices(self) -> dict[StepKey, bool]:
        """For each key: whether it runs compiled."""
        return {key: entry.compiled for key, entry in self._entries.items()}

    def _build(self, spec: StepSpec) -> Callable[..., Any]:
        if not self.enabled or spec.eager:
            return spec.fn
        # A callable of its own per key: MLX keys its traces by the callable's identity and,
        # on every call, compares the inputs' shapes with each trace of that callable in turn
        # until one matches (mlx/compile.cpp, CompileCache::find) - the weights first, as every
        # step takes them first. One callable shared by all of a phase's buckets would make
        # each decode step scan every warmed bucket's ~300 input shapes.
        fn = partial(spec.fn)
        if spec.random_state:
            state = mx.random.state
            return mx.compile(fn, inputs=state, outputs=state, shapeless=spec.shapeless)
        return mx.compile(fn, shapeless=spec.shapeless)
