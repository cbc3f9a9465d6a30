"""A watchdog's view of a thread that may get stuck in an operation no one can interrupt (a
wait on a pipeline group, :mod:`service.engine.group`; an embedding step,
:mod:`service.engine.embedder`): when the operation began and how long it was expected to take.
The thread times its operations with :meth:`StallClock.running`; a watchdog on another thread
reads :meth:`StallClock.stalled_s` and compares it with its limit
(:class:`service.process.watchdog.EngineWatchdog`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StallClock:
    """When the watched thread began its current operation and the seconds it was expected to
    take; read from any thread without a lock (one attribute holds both)."""

    def __init__(self) -> None:
        self._current: tuple[float, float | None] | None = None  # (time.monotonic() at the start, expected_s)

    @contextmanager
    def running(self, expected_s: float | None = None) -> Iterator[None]:
        """Time the block as one operation, expected to take ``expected_s`` seconds (None:
        unknown)."""
        self._current = (time.monotonic(), expected_s)
        try:
            yield
        finally:
            self._current = None

    def stalled_s(self) -> float:
        """Seconds the current operation has lasted (0.0 when none runs)."""
        current = self._current
        return 0.0 if current is None else time.monotonic() - current[0]

    def expected_s(self) -> float | None:
        """Seconds the current operation was expected to take (None: none runs, or unknown)."""
        current = self._current
        return None if current is None else current[1]
