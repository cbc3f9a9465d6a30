"""When an engine thread dies (an exception escaped its loop, warm-up failed, its pipeline
group was lost) or hangs waiting on its pipeline group, or an embedding model's thread dies or
hangs in a step, fail loudly instead of hanging: a failed ``/readyz``, every request it held
answered 500, and a non-zero exit that launchd restarts."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from service.engine.core import Engine
from service.engine.embedder import Embedder

log = logging.getLogger("stepserve.faults")

ENGINE_DIED_EXIT = 70  # EX_SOFTWARE (sysexits.h): an internal error; launchd restarts a non-zero exit
ENGINE_DIED = "the engine thread died; the server is restarting"
EMBEDDER_DIED = "the embedding thread died; the server is restarting"
EMBEDDER_STALLED = "embedding step stalled"  # its /readyz reason
DRAIN_SLACK_S = 30.0  # beyond shutdown_grace_s: cancelling what is left (10 s) and closing uvicorn (10 s), with room
WARMUP_STALL_FACTOR = 10  # before ready, a wait on the group may last this many stall limits (ranks compile)
LOST_RANK_STALL_S = 0.5  # once another rank is known gone, a wait on the group this long is the failure
EMBED_STALL_FACTOR = 20  # an embedding step may take this many times what it is expected to take
EMBED_STALL_MIN_S = 30.0  # ... and at least this long (host hiccups, another model's steps on the CPU)
EMBED_STALL_UNKNOWN_S = 600.0  # a step before any was timed (its rate unknown) may take this long


def embed_stall_limit_s(expected_s: float | None, ready: bool) -> float:
    """Seconds an embedding model's encoder call may last before the watchdog counts its thread
    as stuck: :data:`EMBED_STALL_FACTOR` times ``expected_s`` (the step's padded tokens at the
    slowest rate a step has run at, :attr:`service.engine.embedder.Embedder.clock`), at least
    :data:`EMBED_STALL_MIN_S`; :data:`EMBED_STALL_UNKNOWN_S` when ``expected_s`` is None; before
    ``ready`` (warm-up compiles) :data:`WARMUP_STALL_FACTOR` times that."""
    limit = EMBED_STALL_UNKNOWN_S if expected_s is None else max(EMBED_STALL_MIN_S, EMBED_STALL_FACTOR * expected_s)
    return limit * (1 if ready else WARMUP_STALL_FACTOR)


class EngineWatchdog:
    """Watch the engine threads; when one ends while the server runs (an exception escaped
    its loop, or warm-up failed), fail loudly instead of hanging.

    In order: the model's ``/readyz`` entry turns 503 ("engine thread died"), its queue
    refuses new work, every request it held ends with a 500 naming the failure, and after
    ``linger_s`` (for responses to flush and health checks to see the 503) the process
    sends itself SIGTERM: the usual drain lets other models finish, and ``stepserve
    serve`` then exits with :data:`ENGINE_DIED_EXIT` so launchd restarts it. Should the
    drain hang, the process exits anyway :data:`DRAIN_SLACK_S` seconds after
    ``shutdown_grace_s``.

    An engine of a pipeline group's rank 0 whose wait on the other ranks lasts longer than
    ``stall_limit_s`` (:data:`WARMUP_STALL_FACTOR` times that before it is ready) is failed the
    same way, and the process exits right after ``linger_s``: its thread is stuck in the
    backend's wait, which no drain can end (the ring backend has no timeout). Once `stepserve
    launch` has reported another rank gone (:meth:`peer_lost`), that limit is
    :data:`LOST_RANK_STALL_S` and the requests' error names the rank.

    An embedding model's thread (:class:`service.engine.embedder.Embedder`) is watched as an
    engine's: when it ends while the server runs (warm-up failed, or an exception escaped its
    loop; a failed step only fails its requests), its ``/readyz`` entry turns 503 ("embedding
    thread died"), the requests it held end with a 500 naming it and the process exits with
    :data:`ENGINE_DIED_EXIT` the same way. When one of its encoder calls lasts longer than
    :func:`embed_stall_limit_s` (read from its :class:`~service.engine.stall.StallClock`, the
    clock a group's waits are timed on), the same happens with the reason "embedding step
    stalled": its thread is stuck in MLX, but the chat models can still drain, so the process
    stops by SIGTERM as for a dead thread (the drain does not wait for the stuck thread).

    Args:
        engines: the served engines by model name (the dict the app fills as they start).
        shutdown_grace_s: the SIGTERM drain's grace period (settings).
        poll_s: how often the engine threads are checked.
        linger_s: seconds between failing the requests and the SIGTERM (or the exit).
        stall_limit_s: seconds a wait on the pipeline group may last (None: no group).
        embedders: the embedding models' engines by name (the dict the app fills as they start).
    """

    def __init__(
        self,
        engines: dict[str, Engine],
        shutdown_grace_s: float,
        poll_s: float = 0.2,
        linger_s: float = 1.0,
        stall_limit_s: float | None = None,
        embedders: dict[str, Embedder] | None = None,
    ):
        self.engines, self.poll_s, self.linger_s, self.stall_limit_s = engines, poll_s, linger_s, stall_limit_s
        self.embedders = embedders if embedders is not None else {}
        self.exit_after_s = shutdown_grace_s + DRAIN_SLACK_S
        self.exit_code = 0  # what `stepserve serve` exits with once uvicorn has stopped
        self.failed_at: float | None = None  # time.monotonic() when an engine was failed
        self.lost_rank: str | None = None  # why another rank of the group is gone (peer_lost)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching (call once every engine and embedder has started)."""
        self._thread = threading.Thread(target=self._run, name="stepserve-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (before the engines and embedders are stopped on purpose)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            dead = [engine for engine in list(self.engines.values()) if not engine.alive]  # on-demand ones come and go
            embedders = list(self.embedders.values())
            gone = [embedder for embedder in embedders if not embedder.alive]
            stuck = [embedder for embedder in embedders if embedder.alive and self._embedder_stalled(embedder)]
            if dead or gone or stuck:
                self._fail(dead, gone, stuck)
                return
            hung = [engine for engine in list(self.engines.values()) if self._stalled(engine)]
            if hung:
                self._fail_hung(hung)
                return

    def hold(self) -> None:
        """Once an engine was failed, wait until ``linger_s`` has passed since (the drain calls
        this before uvicorn closes, so health checks see the 503 first)."""
        if self.failed_at is not None:
            time.sleep(max(0.0, self.failed_at + self.linger_s - time.monotonic()))

    def peer_lost(self, reason: str) -> None:
        """Another rank of the group is gone (``reason``, e.g. "rank 1 exited with code -9", from
        `stepserve launch`'s SIGUSR1): from now on a wait on the group that lasts
        :data:`LOST_RANK_STALL_S` fails the engine with an error naming it. The engine thread
        usually raises first (the ring backend fails the collectives pending when a peer's
        socket closes), but a collective started just after the failure may wait forever.
        Safe to call from a signal handler: it only sets an attribute."""
        self.lost_rank = reason

    def _stalled(self, engine: Engine) -> bool:
        if self.stall_limit_s is None:
            return False
        if self.lost_rank is not None:
            limit = LOST_RANK_STALL_S
        else:
            limit = self.stall_limit_s * (1 if engine.ready.is_set() else WARMUP_STALL_FACTOR)
        return engine.executor.stalled_s() > limit

    def _embedder_stalled(self, embedder: Embedder) -> bool:
        limit = embed_stall_limit_s(embedder.clock.expected_s(), embedder.ready.is_set())
        return embedder.clock.stalled_s() > limit

    def _fail_hung(self, hung: list[Engine]) -> None:
        self.exit_code, self.failed_at = ENGINE_DIED_EXIT, time.monotonic()
        for engine in hung:
            seconds = engine.executor.stalled_s()
            if self.lost_rank is not None:  # stepserve launch saw the rank exit
                why, reason = f"{self.lost_rank} (stepserve launch)", "pipeline group lost"
                message = f"the pipeline group failed: {self.lost_rank}; the group is restarting"
            else:
                why = f"the pipeline group has not answered for {seconds:.1f} s (a rank hung, or its link)"
                message = f"the pipeline group stopped answering for {seconds:.0f} s; the group is restarting"
                reason = "pipeline group stopped answering"
            log.critical(
                "model '%s': %s; failing the requests, then exiting with %d", engine.model.name, why, ENGINE_DIED_EXIT
            )
            engine.fail(message, reason=reason)
        if self._stop.wait(self.linger_s):
            return
        logging.shutdown()
        os._exit(ENGINE_DIED_EXIT)  # the engine thread is stuck in the backend's wait: no drain can end it

    def _fail(
        self, dead: list[Engine], gone: list[Embedder] | None = None, stuck: list[Embedder] | None = None
    ) -> None:
        """Fail the engines ``dead`` and the embedders ``gone`` (their threads ended) or
        ``stuck`` (in a step past its limit), then, after ``linger_s``, SIGTERM this process
        (the drain), with a backstop exit."""
        self.exit_code, self.failed_at = ENGINE_DIED_EXIT, time.monotonic()
        for embedder in gone or []:
            log.critical(
                "the embedding thread of model '%s' died; failing its requests, then exiting with %d",
                embedder.model.name,
                ENGINE_DIED_EXIT,
            )
            embedder.fail(EMBEDDER_DIED)
        for embedder in stuck or []:
            seconds = embedder.clock.stalled_s()
            log.critical(
                "model '%s': an embedding step has not finished for %.1f s (expected %s); failing its requests, "
                "then exiting with %d",
                embedder.model.name,
                seconds,
                "unknown" if (expected := embedder.clock.expected_s()) is None else f"{expected:.3f} s",
                ENGINE_DIED_EXIT,
            )
            message = f"the embedding model's step has not finished for {seconds:.0f} s; the server is restarting"
            embedder.fail(message, reason=EMBEDDER_STALLED)
        for engine in dead:
            log.critical(
                "the engine thread of model '%s' died; failing its requests, then exiting with %d",
                engine.model.name,
                ENGINE_DIED_EXIT,
            )
            if engine.failure is not None:
                engine.fail(engine.failure, reason="pipeline group lost")
            else:
                engine.fail(ENGINE_DIED)
        if self._stop.wait(self.linger_s):
            return
        backstop = threading.Timer(self.exit_after_s, os._exit, (ENGINE_DIED_EXIT,))
        backstop.daemon = True
        backstop.start()
        os.kill(os.getpid(), signal.SIGTERM)
