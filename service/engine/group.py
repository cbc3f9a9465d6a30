"""A pipeline group's executors: rank 0 tells the other ranks every operation, each rank runs
it on its own stage (docs/DISTRIBUTED.md).

Every rank holds one :class:`~service.engine.executor.Executor` on its stage. Rank 0's is a
:class:`GroupLeader`: each operation first broadcasts a **message** (one ``mx.distributed``
all-sum in which the other ranks add zeros, evaluated: a lazy collective deadlocks), then runs
on rank 0's own layers. The other ranks run :class:`~service.engine.follower.Follower`: receive
a message, run the same operation of their executor on their own layers, evaluate it (the stage
steps' ``send`` and ``recv`` happen there, in the order rank 0 queued them), and wait for the next.

A message is int32 ``[op, frees, ints, data, <frees ids>, <ints>, <data>]``: the operation,
the handles rank 0 no longer holds (freed first), the operation's integers (handles, buckets,
offsets, slots) and its int32 arrays (tokens, lengths, positions). It rides in one broadcast of
:data:`HEADER` int32s when it fits (a decode step up to batch 64 does), else a header carrying
its length is followed by a second broadcast of the whole message.

**Handles.** Every KV cache and prefix-cache block that rank 0 keeps has a number, and each
other rank keeps its own layers' counterpart under that number. Rank 0's counterpart is its own
array: a handle is anchored on it (on a cache's first keys array) with :class:`weakref.finalize`,
so when the runner, the prefiller or the prefix cache drop an object, its handle is freed on the
other ranks with the next message; nothing tracks lifetimes by hand. An operation that replaces
a cache (a step, a resize) keeps its handle: each rank swaps its cache under that number, so the
old buffers are unreferenced when the step runs, as in one process.

**Order.** Each rank must run the group's collectives in the same order. A follower
evaluates each operation before it waits for the next message; rank 0 queues its step's
logits and cache (``mx.async_eval``) before its next broadcast: a step left lazy (say a
prefill's logits, read only later) would leave its ``recv`` or an mlx-lm stage's
``all_gather`` for after that broadcast, while the followers wait in it: a deadlock.

**Faults.** An evaluation that fails on rank 0 or a follower (``[ring] connection to a peer was
lost`` when a rank died) raises :class:`GroupLost`; a wait that never ends (a rank hung: the
ring backend has no timeout) is seen by a watchdog through :meth:`GroupLeader.stalled_s` and
:attr:`~service.engine.follower.Follower.progress` (:mod:`service.process.group`).
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import IntEnum
from typing import Any, TypeVar, cast

import mlx.core as mx

from models.kv_cache import KVCache
from models.loader import LoadedModel
from models.paged import PagedKV
from models.pipeline import broadcast
from service.engine.block_pool import BlockCopy
from service.engine.compile_cache import CompileCache
from service.engine.executor import MODEL_PHASES, DecodeCache, Executor, PagedTables
from service.engine.stall import StallClock

log = logging.getLogger("stepserve.group")

F = TypeVar("F", bound=Callable[..., Any])
HEADER = 160  # int32s in every message's first broadcast: a decode step of up to 64 rows fits whole
NAP_S = 0.1  # when idle, rank 0 sends a message this often and the others sleep between them


class Op(IntEnum):
    """A message's operation."""

    IDLE = 0  # nothing to do: sleep ``ints[0]`` ms before waiting again (a heartbeat)
    STOP = 1  # exit: the server stops
    SEAL = 2  # warm-up is over
    ALLOC = 3
    PREFILL = 4
    CHUNK = 5
    DECODE = 6
    RESIZE = 7
    REORDER = 8
    RESIZE_BATCH = 9
    INSERT = 10
    SAVE_BLOCKS = 11
    GATHER = 12
    WARM = 13
    USE_PAGED = 14  # the paged KV pool: every rank allocates rank 0's number of blocks for its layers
    DECODE_PAGED = 15  # a decode step over block tables (rank 0's, sent when they changed)
    WRITE_BLOCKS = 16
    READ_BLOCKS = 17
    COPY_POOL = 18


class GroupLost(BaseException):
    """Another rank of the pipeline group is gone (its link failed or it exited): nothing can
    run any more, on any rank.

    A ``BaseException``, like ``SystemExit``: the engine's ``except Exception`` handlers, which
    keep one failed request from ending the others, must not swallow it; the engine thread ends,
    and the process with it (:class:`service.process.watchdog.EngineWatchdog`).
    """


def executor_for(model: LoadedModel, cache: CompileCache) -> Executor:
    """The engine's executor for ``model``: a :class:`GroupLeader` on rank 0 of a pipeline
    group, else one process's :class:`Executor` (a follower's is one too, driven by
    :class:`~service.engine.follower.Follower`)."""
    if model.group is not None and model.group.size() > 1 and model.group.rank() == 0:
        return GroupLeader(model, cache)
    return Executor(model, cache)


class Progress(StallClock):
    """When this process began waiting on the group (:meth:`StallClock.stalled_s`, 0 when not
    waiting): a watchdog's view."""

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Time the block as a wait on the group; an exception in it becomes :class:`GroupLost`."""
        with self.running():
            try:
                yield
            except Exception as exc:
                raise GroupLost(f"the pipeline group failed: {exc}") from exc


def ints_of(x: mx.array) -> list[int]:
    """A 1-D int32 array as host ints."""
    return cast(list[int], x.tolist())


def group_of(executor: Executor) -> mx.distributed.Group:
    """The ``mx.distributed`` group of ``executor``'s stage. Raises ValueError if it has none."""
    group = executor.model.group
    if group is None:
        raise ValueError(f"model '{executor.model.name}' is not a pipeline stage of a group")
    return group


def _guarded(method: F) -> F:
    """A :class:`GroupLeader` operation: its time counts as a wait on the group (the
    watchdog's view), and anything it raises (an evaluation, or a collective of an earlier
    step failing here) is :class:`GroupLost`."""

    @functools.wraps(method)
    def run(self: GroupLeader, *args, **kwargs):
        with self.progress.waiting():
            return method(self, *args, **kwargs)

    return cast(F, run)


def _anchor(obj: KVCache | mx.array) -> mx.array:
    """The array a handle lives on: a cache's first keys buffer, or the array itself."""
    return obj.keys[0] if isinstance(obj, KVCache) else obj


class GroupLeader(Executor):
    """Rank 0's executor: every operation is broadcast to the group, then run here (see the
    module doc). Called from the engine thread only (finalizers may run elsewhere)."""

    def __init__(self, model: LoadedModel, cache: CompileCache):
        super().__init__(model, cache)
        self.batches_chunks = False  # each chunk is one broadcast operation: a group prefills them one by one
        self.group = group_of(self)
        self.progress = Progress()
        self._handles: dict[int, tuple[int, weakref.finalize]] = {}  # id(anchor) -> (handle, finalizer)
        self._frees: deque[int] = deque()  # handles whose object died, for the next message
        self._next = 0
        self._last_sent = 0.0
        self._table: mx.array | None = None  # the block tables the followers hold (the last sent)

    # -- messages and handles ----------------------------------------------------------------

    def _send(self, op: Op, ints: list[int], data: tuple[mx.array, ...] = ()) -> None:
        frees = []
        while self._frees:
            frees.append(self._frees.popleft())
        size = sum(a.size for a in data)
        head = [int(op), len(frees), len(ints), size, *frees, *ints]
        parts = [mx.array(head, mx.int32), *(a.reshape(-1).astype(mx.int32) for a in data)]
        total = len(head) + size
        if total > HEADER:
            broadcast(mx.array(head[:4] + [0] * (HEADER - 4), mx.int32), self.group)
        else:
            parts.append(mx.zeros((HEADER - total,), mx.int32))
        broadcast(mx.concatenate(parts), self.group)
        self._last_sent = time.monotonic()

    def _bind(self, obj, handle: int | None = None):
        """Give ``obj`` (a cache or a block) ``handle``, or a new one; returns ``obj``."""
        if handle is None:
            self._next += 1
            handle = self._next
        anchor = _anchor(obj)
        key = id(anchor)
        self._handles[key] = (handle, weakref.finalize(anchor, self._forget, key, handle))
        return obj

    def _forget(self, key: int, handle: int) -> None:
        """The anchor of ``handle`` died (before its id can be reused): free it everywhere."""
        self._handles.pop(key, None)
        self._frees.append(handle)

    def _handle(self, obj) -> int:
        return self._handles[id(_anchor(obj))][0]

    def _new_handle(self) -> int:
        return self._next + 1  # what the next _bind without a handle assigns

    def _rebind(self, old, new):
        """Move ``old``'s handle to ``new`` (an operation replaced it); returns ``new``."""
        if _anchor(new) is _anchor(old):
            return new
        handle, finalizer = self._handles.pop(id(_anchor(old)))
        finalizer.detach()
        return self._bind(new, handle)

    # -- operations: broadcast, then run here ----------------------------------------------

    @_guarded
    def alloc(self, batch: int, capacity: int, ring: bool = False) -> KVCache:
        self._send(Op.ALLOC, [self._new_handle(), batch, capacity, int(ring)])
        return self._bind(super().alloc(batch, capacity, ring))

    @_guarded
    def prefill(self, tokens: list[list[int]], lengths: list[int]) -> tuple[mx.array, KVCache]:
        B, T = len(tokens), len(tokens[0])
        self._send(Op.PREFILL, [self._new_handle(), B, T], (mx.array(tokens, mx.int32), mx.array(lengths, mx.int32)))
        logits, kv = super().prefill(tokens, lengths)
        # Every step's collectives are queued now, in the followers' order: the recv is in the
        # cache's graph; an mlx-lm stage's all-gather of the last hidden states in the logits'.
        mx.async_eval(logits, kv)
        return logits, self._bind(kv)

    @_guarded
    def chunk(self, kv: KVCache, tokens: list[int], offset: int, length: int) -> tuple[mx.array, KVCache]:
        self._send(Op.CHUNK, [self._handle(kv), offset, length], (mx.array(tokens, mx.int32),))
        logits, new = super().chunk(kv, tokens, offset, length)
        mx.async_eval(logits, new)
        return logits, self._rebind(kv, new)

    @_guarded
    def decode(self, kv: DecodeCache, tokens: mx.array, positions: list[int]) -> tuple[mx.array, DecodeCache]:
        # The tokens may still be the previous step's lazy output: the broadcast waits for them.
        at = mx.array(positions, mx.int32)
        if isinstance(kv, PagedTables):  # the tables ride the message only when they changed
            fresh = kv.table is not self._table
            self._send(Op.DECODE_PAGED, [kv.batch, kv.capacity, int(fresh)], (tokens, at, kv.table)[: 2 + fresh])
            self._table = kv.table
            logits, tables = super().decode(kv, tokens, positions)
            mx.async_eval(logits, self.pool)
            return logits, tables
        self._send(Op.DECODE, [self._handle(kv)], (tokens, at))
        logits, new = super().decode(kv, tokens, positions)
        mx.async_eval(logits, new)
        return logits, self._rebind(kv, new)

    def use_paged(self, num_blocks: int, block_tokens: int, bits: int | None = None, group_size: int = 64) -> PagedKV:
        # Here first: its ValueError is one process's (not GroupLost), before another rank allocates.
        pool = super().use_paged(num_blocks, block_tokens, bits, group_size)
        with self.progress.waiting():
            self._send(Op.USE_PAGED, [num_blocks, block_tokens, bits or 0, group_size])
        return pool

    @_guarded
    def write_blocks(self, source: KVCache, row: int, blocks: list[int], length: int, start: int = 0) -> None:
        if blocks:
            self._send(Op.WRITE_BLOCKS, [self._handle(source), row, length, start, *blocks])
        super().write_blocks(source, row, blocks, length, start)

    @_guarded
    def read_blocks(self, blocks: list[int], capacity: int) -> KVCache:
        self._send(Op.READ_BLOCKS, [self._new_handle(), capacity, *blocks])
        return self._bind(super().read_blocks(blocks, capacity))

    @_guarded
    def copy_pool_blocks(self, copies: list[BlockCopy]) -> None:
        if copies:
            self._send(Op.COPY_POOL, [*(c.src for c in copies), *(c.dst for c in copies)])
        super().copy_pool_blocks(copies)

    @_guarded
    def resize(self, kv: KVCache, capacity: int, ring: bool = True) -> KVCache:
        self._send(Op.RESIZE, [self._handle(kv), capacity, int(ring)])
        return self._rebind(kv, super().resize(kv, capacity, ring))

    @_guarded
    def reorder(self, kv: KVCache, rows: list[int]) -> KVCache:
        self._send(Op.REORDER, [self._handle(kv), *rows])
        return self._rebind(kv, super().reorder(kv, rows))

    @_guarded
    def resize_batch(self, kv: KVCache, batch: int) -> KVCache:
        self._send(Op.RESIZE_BATCH, [self._handle(kv), batch])
        return self._rebind(kv, super().resize_batch(kv, batch))

    @_guarded
    def insert_rows(self, kv: KVCache, source: KVCache, slots: list[int], rows: list[int], lengths: list[int]) -> None:
        self._send(Op.INSERT, [self._handle(kv), self._handle(source), *slots, *rows, *lengths])
        super().insert_rows(kv, source, slots, rows, lengths)

    @_guarded
    def save_blocks(self, kv: KVCache, rows: list[int], starts: list[int], block_tokens: int) -> list[mx.array]:
        first = self._new_handle()
        self._send(Op.SAVE_BLOCKS, [self._handle(kv), block_tokens, first, len(rows), *rows, *starts])
        return [self._bind(block) for block in super().save_blocks(kv, rows, starts, block_tokens)]

    @_guarded
    def gather_blocks(self, blocks: list[mx.array], capacity: int) -> KVCache:
        self._send(Op.GATHER, [self._new_handle(), capacity, *(self._handle(b) for b in blocks)])
        return self._bind(super().gather_blocks(blocks, capacity))

    @_guarded
    def warm(self, phase: str, batch: int, size: int, capacity: int = 0, repeats: int = 3) -> bool:
        if phase not in MODEL_PHASES:  # the sampler runs where the logits are
            return super().warm(phase, batch, size, capacity, repeats)
        self._send(Op.WARM, [MODEL_PHASES.index(phase), batch, size, capacity, repeats])
        return super().warm(phase, batch, size, capacity, repeats)

    # -- waiting and the group's life ------------------------------------------------------

    @_guarded
    def wait(self, *arrays) -> None:
        super().wait(*arrays)

    @_guarded
    def read(self, tokens: mx.array) -> list[int]:
        return super().read(tokens)

    @_guarded
    def seal(self) -> None:
        super().seal()
        self._send(Op.SEAL, [])

    @_guarded
    def idle(self) -> None:
        """A heartbeat at most every :data:`NAP_S`: the others sleep that long (less a margin)
        instead of spinning in the ring backend's wait (it polls its socket); the first
        operation after an idle spell waits up to that long for them."""
        if time.monotonic() - self._last_sent >= NAP_S:
            self._send(Op.IDLE, [int(NAP_S * 900)])  # 90% of the period, in ms

    @_guarded
    def close(self) -> None:
        self._send(Op.STOP, [])

    def stalled_s(self) -> float:
        return self.progress.stalled_s()

    def raise_if_fatal(self, exc: Exception) -> None:
        raise GroupLost(f"the pipeline group failed: {exc}") from exc
