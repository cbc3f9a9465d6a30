"""Graceful shutdown on SIGTERM (what launchd sends): drain, then exit 0.

On SIGTERM the server stops admitting (``/readyz`` and new requests answer 503), lets
running and queued requests finish for up to ``shutdown_grace_s``, ends whatever is left as
``cancelled`` with the message "server shutting down" (streams get a final event), and then
lets uvicorn close. A second SIGTERM or a SIGINT keeps uvicorn's own behaviour.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Protocol

import uvicorn

from service.engine.core import Engine

log = logging.getLogger("stepserve.shutdown")
POLL_S = 0.05
ABORT_WAIT_S = 10.0


class Serving(Protocol):
    """What the drain needs of the app's state."""

    engines: dict[str, Engine]
    draining: bool  # set on SIGTERM: /readyz and new requests answer 503


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose SIGTERM drains the engines first; ``before_exit`` is called
    once they are idle, before uvicorn closes (the watchdog's hold: a failed engine's 503
    stays visible for its linger even when SIGTERM comes from outside, e.g. mlx.launch
    stopping a pipeline group whose other rank died)."""

    def __init__(
        self, config: uvicorn.Config, state: Serving, grace_s: float, before_exit: Callable[[], None] = lambda: None
    ):
        super().__init__(config)
        self.state, self.grace_s, self.before_exit = state, grace_s, before_exit
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM or self._draining:
            super().handle_exit(sig, frame)
            return
        self._draining = True  # not re-raised after serving: a drained SIGTERM exits 0
        threading.Thread(target=self._drain, name="stepserve-drain", daemon=True).start()

    def _drain(self) -> None:
        engines = list(self.state.engines.values())
        self.state.draining = True
        for engine in engines:
            engine.drain()
        log.info("SIGTERM: draining for up to %.0f s", self.grace_s)
        if not _wait_idle(engines, self.grace_s):
            log.warning("grace period over: cancelling the requests still running")
            for engine in engines:
                engine.abort_all()
            _wait_idle(engines, ABORT_WAIT_S)
        self.before_exit()
        self.should_exit = True


def _wait_idle(engines: list[Engine], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(e.idle for e in engines):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True
