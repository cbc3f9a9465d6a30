"""Running a phase of a thread's work on a thread of its own.

glibc's malloc gives each thread an arena of its own. A warm-up that traces every bucket
allocates a great deal that lives on (the traces) between a great deal it frees (their
temporaries), leaving its thread's arena large and fragmented, and every later allocation on
that thread pays for it: a decode step makes thousands (MLX's arrays and graph nodes). The
warm-up of an engine, of a pipeline group's follower ranks and of an embedding model therefore
runs on a thread of its own, and serving allocates in an arena the warm-up did not touch (measured in
docs/BENCHMARKS.md, "One stream").
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def on_own_thread(fn: Callable[[], None], name: str) -> None:
    """Run ``fn`` on a new thread named ``name``, wait for it to end, and raise here what it
    raised (any exception, as is), so the caller sees the same outcome as a direct call."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the caller's thread as is
            raised.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if raised:
        raise raised[0]
