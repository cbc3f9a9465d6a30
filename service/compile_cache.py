"""The compile cache: the only place stepserve calls ``mx.compile``.

One compiled function per :class:`StepKey` (model, phase, batch bucket, prompt or capacity
bucket, dtype). Every lookup counts a hit or a miss; the first call of a new entry is timed
(``mx.compile`` is lazy: tracing and kernel building happen on that call) and reported as
its compile time. With compilation off the same functions are stored and run eagerly, so
``--compile off`` is the exact eager baseline.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from service.metrics import CompileStat


@dataclass(frozen=True)
class StepKey:
    """What a compiled function is specialised to.

    Attributes:
        model: the model's name.
        phase: "prefill", "decode", "sample" or "greedy".
        batch: batch bucket B (0 for shapeless functions).
        size: prompt bucket T (prefill) or capacity bucket C (decode); 0 where none applies.
        dtype: compute dtype name.
    """

    model: str
    phase: str
    batch: int
    size: int
    dtype: str

    @property
    def bucket(self) -> str:
        """Label value: ``b{B}`` or ``b{B}x{T|C}``; ``any`` for shapeless functions."""
        if self.batch == 0:
            return "any"
        return f"b{self.batch}" + (f"x{self.size}" if self.size else "")


@dataclass(frozen=True)
class StepSpec:
    """How to compile one phase: the pure function and its compile options.

    Attributes:
        fn: the pure step function (hyper-parameters already bound).
        shapeless: compile once for all shapes (only where a test proves it safe).
        random_state: capture ``mx.random.state`` as compile input and output.
    """

    fn: Callable[..., Any]
    shapeless: bool = False
    random_state: bool = False


class _Entry:
    """A compiled function whose first call is timed and reported."""

    def __init__(self, key: StepKey, fn: Callable[..., Any], on_compiled: Callable[[CompileStat], None]):
        self.key, self._fn, self._on_compiled = key, fn, on_compiled
        self.compile_seconds: float | None = None

    def __call__(self, *args):
        if self.compile_seconds is not None:
            return self._fn(*args)
        start = time.perf_counter()
        out = self._fn(*args)
        mx.eval(out)
        self.compile_seconds = time.perf_counter() - start
        self._on_compiled(CompileStat(self.key.model, self.key.phase, self.key.bucket, self.compile_seconds))
        return out


class CompileCache:
    """Compiled step functions keyed by bucket.

    Args:
        enabled: False stores the functions uncompiled (eager).
        on_lookup: called with (model, phase, bucket, hit) for every lookup.
        on_compiled: called with a :class:`CompileStat` after each entry's first call.
    """

    def __init__(
        self,
        enabled: bool,
        on_lookup: Callable[[str, str, str, bool], None],
        on_compiled: Callable[[CompileStat], None],
    ):
        self.enabled = enabled
        self._on_lookup, self._on_compiled = on_lookup, on_compiled
        self._entries: dict[StepKey, _Entry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[StepKey]:
        return list(self._entries)

    def get(self, key: StepKey, spec: StepSpec) -> Callable[..., Any]:
        """The function for ``key``, compiling ``spec`` on the first lookup (a miss)."""
        with self._lock:
            entry = self._entries.get(key)
            hit = entry is not None
            if entry is None:
                entry = _Entry(key, self._build(spec), self._on_compiled)
                self._entries[key] = entry
        self._on_lookup(key.model, key.phase, key.bucket, hit)
        return entry

    def _build(self, spec: StepSpec) -> Callable[..., Any]:
        if not self.enabled:
            return spec.fn
        if spec.random_state:
            state = mx.random.state
            return mx.compile(spec.fn, inputs=state, outputs=state, shapeless=spec.shapeless)
        return mx.compile(spec.fn, shapeless=spec.shapeless)
