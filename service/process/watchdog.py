"""What stepserve does when memory or the engine fails: refuse what would not fit, and turn
a dead engine thread into a failed ``/readyz`` and a non-zero exit instead of a hang.

Memory. ``mx.set_memory_limit`` does not make an allocation fail in MLX 0.32. In MLX's
source the limit throttles evaluation (``eval_impl`` waits for running work while active
memory is over it), and the CPU allocator (``CommonAllocator::malloc``) never reads it at
all. Measured on this Linux CPU: with the limit at 200 MB a 400 MB array allocates fine,
and an array larger than physical memory kills the process with a segmentation fault
(``malloc`` returns NULL and is written through) — nothing Python can catch. So requests
are admitted against an estimate instead: before a request is queued, the KV caches its
model would hold with it and everything already running or waiting are added to the
weights, and a total over MLX's memory limit answers 503.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import mlx.core as mx

from service.api.errors import ApiError
from service.api.state import AppState
from service.engine.core import Engine
from service.engine.sequence import FinishReason
from service.process.memory import kv_bytes_per_position

log = logging.getLogger("stepserve.faults")

ENGINE_DIED_EXIT = 70  # EX_SOFTWARE (sysexits.h): an internal error; launchd restarts a non-zero exit
ENGINE_DIED = "the engine thread died; the server is restarting"
DRAIN_SLACK_S = 30.0  # beyond shutdown_grace_s: cancelling what is left (10 s) and closing uvicorn (10 s), with room
SCORES_BYTES = 4  # float32 attention scores of MLX's CPU fallback for scaled_dot_product_attention


def queued(engine: Engine) -> list[tuple[int, int]]:
    """(prompt tokens, max_tokens) of every request ``engine`` runs or queues now."""
    sched = engine.scheduler
    # tuple() of a list or deque copies it in C, atomically under the GIL, while the engine runs.
    return [(len(s.prompt_ids), s.params.max_tokens) for s in (*tuple(sched.running), *tuple(sched.waiting))]


def engine_bytes(engine: Engine, rows: list[tuple[int, int]]) -> int:
    """Bytes ``engine`` may hold while serving ``rows`` of (prompt tokens, max_tokens).

    Weights, plus twice the decode KV cache (a bucket move holds the old and the new one) at
    (batch bucket of the rows that can run at once, capacity bucket of the longest prompt +
    max_tokens), plus the prefill of ``max_admit`` of the longest prompts: its KV cache and
    its float32 attention scores (B x heads x T x T, which MLX's CPU fallback materializes).
    Requests may stop early, so this bounds the load from above.
    """
    if not rows:
        return engine.model.nbytes
    buckets, a = engine.buckets, engine.model.args
    per_position = kv_bytes_per_position(engine.model)
    running = min(len(rows), engine.scheduler.max_running)
    batch = buckets.batch_for(running)
    capacity = buckets.capacity_for(min(max(p + m for p, m in rows), buckets.capacity[-1]))
    prompt = buckets.prompt_for(min(max(p for p, _ in rows), buckets.prompt[-1]))
    prefill_rows = buckets.batch_for(min(running, engine.scheduler.max_admit))
    prefill = prefill_rows * prompt * (per_position + a.num_attention_heads * prompt * SCORES_BYTES)
    return engine.model.nbytes + 2 * batch * capacity * per_position + prefill


def admit_memory(state: AppState, engine: Engine, prompt_tokens: int, max_tokens: int) -> None:
    """Refuse a request whose admission could take MLX past its memory limit.

    The limit is ``mx.get_memory_limit()`` (``mlx_memory_limit_bytes`` when set, else MLX's
    default); the need is :func:`engine_bytes` summed over every served model, with this
    request added to ``engine``'s.

    Raises:
        ApiError: 503 naming the need and the limit; with ``Retry-After`` when the request
            would fit on an idle server (it is the current load that does not).
    """
    limit, request = mx.get_memory_limit(), (prompt_tokens, max_tokens)
    need = sum(engine_bytes(e, queued(e) + ([request] if e is engine else [])) for e in state.engines.values())
    if need <= limit:
        return
    state.metrics.queue_rejections.labels(engine.model.name, "memory").inc()
    alone = sum(e.model.nbytes for e in state.engines.values() if e is not engine) + engine_bytes(engine, [request])
    if alone > limit:
        raise ApiError(
            503,
            f"not enough memory: this request (prompt {prompt_tokens} tokens, max_tokens {max_tokens}) "
            f"could need {alone / 1e9:.2f} GB even alone, over MLX's memory limit of {limit / 1e9:.2f} GB; "
            "lower max_tokens or shorten the prompt",
            type="unavailable",
            param="max_tokens",
        )
    raise ApiError(
        503,
        f"not enough memory now: with the requests already running or waiting this one could need "
        f"{need / 1e9:.2f} GB, over MLX's memory limit of {limit / 1e9:.2f} GB; retry later",
        type="unavailable",
        param="max_tokens",
        headers={"Retry-After": "1"},
    )


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
    """

    def __init__(self, state: AppState, poll_s: float = 0.2, linger_s: float = 1.0):
        self.state, self.poll_s, self.linger_s = state, poll_s, linger_s
        self.exit_after_s = state.settings.shutdown_grace_s + DRAIN_SLACK_S
        self.exit_code = 0  # what `stepserve serve` exits with once uvicorn has stopped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching (call once every engine has started)."""
        self._thread = threading.Thread(target=self._run, name="stepserve-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (before the engines are stopped on purpose)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            dead = [engine for engine in self.state.engines.values() if not engine.alive]
            if dead:
                self._fail(dead)
                return

    def _fail(self, dead: list[Engine]) -> None:
        self.exit_code = ENGINE_DIED_EXIT
        for engine in dead:
            log.critical(
                "the engine thread of model '%s' died; failing its requests, then exiting with %d",
                engine.model.name,
                ENGINE_DIED_EXIT,
            )
            engine.not_ready_reason = "engine thread died"
            engine.ready.clear()
            engine.scheduler.drain()
            for seq in engine.scheduler.abort_all(FinishReason.ERROR):
                seq.emit(seq.final_event(ENGINE_DIED))
        if self._stop.wait(self.linger_s):
            return
        backstop = threading.Timer(self.exit_after_s, os._exit, (ENGINE_DIED_EXIT,))
        backstop.daemon = True
        backstop.start()
        os.kill(os.getpid(), signal.SIGTERM)
