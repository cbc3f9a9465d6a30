"""A pipeline group's ranks other than 0: each replays rank 0's operations on its own stage
(the messages, handles and faults are described in :mod:`service.engine.group`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import mlx.core as mx

from models.kv_cache import KVCache
from models.pipeline import broadcast
from service.engine.block_pool import BlockCopy
from service.engine.executor import MODEL_PHASES, Executor, PagedTables
from service.engine.group import HEADER, Op, Progress, group_of, ints_of
from service.engine.threads import on_own_thread


class Follower:
    """A rank other than 0: runs rank 0's operations on its own stage until told to stop.

    Args:
        executor: this rank's executor (its stage, its compile cache).
        nap: how it sleeps after an idle message (seconds).
    """

    def __init__(self, executor: Executor, nap: Callable[[float], None] = time.sleep):
        self.executor, self._nap = executor, nap
        self.group = group_of(executor)
        self.progress = Progress()
        self.warming = True  # until rank 0's SEAL
        self.store: dict[int, KVCache | mx.array] = {}  # handle -> this rank's cache or block
        self.table: mx.array | None = None  # the paged decode steps' block tables, as rank 0 last sent them
        self._ops: dict[Op, Callable[[list[int], mx.array], None]] = {
            Op.ALLOC: self._alloc,
            Op.PREFILL: self._prefill,
            Op.CHUNK: self._chunk,
            Op.DECODE: self._decode,
            Op.RESIZE: lambda i, _: self._put(i[0], self.executor.resize(self._kv(i[0]), i[1], bool(i[2]))),
            Op.REORDER: lambda i, _: self._put(i[0], self.executor.reorder(self._kv(i[0]), i[1:])),
            Op.RESIZE_BATCH: lambda i, _: self._put(i[0], self.executor.resize_batch(self._kv(i[0]), i[1])),
            Op.INSERT: self._insert,
            Op.SAVE_BLOCKS: self._save_blocks,
            Op.GATHER: self._gather,
            Op.WARM: self._warm,
            Op.USE_PAGED: self._use_paged,
            Op.DECODE_PAGED: self._decode_paged,
            Op.WRITE_BLOCKS: lambda i, _: self.executor.write_blocks(self._kv(i[0]), i[1], i[4:], i[2], i[3]),
            Op.READ_BLOCKS: lambda i, _: self._put(i[0], self.executor.read_blocks(i[2:], i[1])),
            Op.COPY_POOL: self._copy_pool,
        }

    def run(self) -> None:
        """Serve rank 0's messages until STOP. Raises :class:`GroupLost` when the group fails.

        The messages up to rank 0's SEAL (its warm-up) are carried out on a thread of their
        own, the rest on this one (:mod:`service.engine.threads`)."""
        stopped = False

        def warm_up() -> None:
            nonlocal stopped
            while self.warming and not stopped:
                stopped = not self.step()

        on_own_thread(warm_up, "stepserve-follower-warmup")
        while not stopped and self.step():
            pass

    def step(self) -> bool:
        """Receive and carry out one message; False once it was STOP."""
        op, ints, data = self._receive()
        if op == Op.STOP:
            return False
        if op == Op.IDLE:
            self._nap(ints[0] / 1000)
        elif op == Op.SEAL:
            self.executor.seal()
            # Evaluated on this (the warm-up) thread, which made them: a lazy array made on a
            # thread that has ended cannot be evaluated on another (as the engine's _prepare).
            mx.eval([a for a in (self.executor.pool, self.table, *self.store.values()) if a is not None])
            self.warming = False
        else:
            with self.progress.waiting():
                self._ops[op](ints, data)
        return True

    def _receive(self) -> tuple[Op, list[int], mx.array]:
        with self.progress.waiting():
            first = broadcast(mx.zeros((HEADER,), mx.int32), self.group)
            op, n_free, n_ints, size = ints_of(first[:4])
            head = 4 + n_free + n_ints
            message = first if head + size <= HEADER else broadcast(mx.zeros((head + size,), mx.int32), self.group)
            values = ints_of(message[:head])
        for handle in values[4 : 4 + n_free]:
            self.store.pop(handle, None)
        return Op(op), values[4 + n_free :], message[head : head + size]

    def _kv(self, handle: int) -> KVCache:
        kv = self.store[handle]
        assert isinstance(kv, KVCache)
        return kv

    def _put(self, handle: int, obj: KVCache | mx.array) -> None:
        self.store[handle] = obj

    def _alloc(self, ints: list[int], _: mx.array) -> None:
        self._put(ints[0], self.executor.alloc(ints[1], ints[2], bool(ints[3])))

    def _prefill(self, ints: list[int], data: mx.array) -> None:
        handle, B, T = ints
        tokens = cast(list[list[int]], data[: B * T].reshape(B, T).tolist())
        out, kv = self.executor.prefill(tokens, ints_of(data[B * T :]))
        self._put(handle, kv)
        mx.eval(out, kv)  # the stage's send (or recv and send) runs here

    def _chunk(self, ints: list[int], data: mx.array) -> None:
        handle, offset, length = ints
        out, kv = self.executor.chunk(self._kv(handle), ints_of(data), offset, length)
        self._put(handle, kv)
        mx.eval(out, kv)

    def _decode(self, ints: list[int], data: mx.array) -> None:
        kv = self._kv(ints[0])
        B = kv.batch
        out, kv = self.executor.decode(kv, data[:B], ints_of(data[B:]))
        self._put(ints[0], kv)
        mx.eval(out, kv)

    def _use_paged(self, ints: list[int], _: mx.array) -> None:
        num_blocks, block_tokens, bits, group_size = ints
        self.executor.use_paged(num_blocks, block_tokens, bits or None, group_size)

    def _decode_paged(self, ints: list[int], data: mx.array) -> None:
        B, C, fresh = ints
        if fresh:
            self.table = data[2 * B :].reshape(B, -1)
        assert self.table is not None and self.table.shape[0] == B, "a paged decode step without its tables"
        out, _ = self.executor.decode(PagedTables(self.table, B, C), data[:B], ints_of(data[B : 2 * B]))
        mx.eval(out, self.executor.pool)

    def _copy_pool(self, ints: list[int], _: mx.array) -> None:
        n = len(ints) // 2
        self.executor.copy_pool_blocks([BlockCopy(src, dst) for src, dst in zip(ints[:n], ints[n:], strict=True)])

    def _insert(self, ints: list[int], _: mx.array) -> None:
        dst, src, *rest = ints
        n = len(rest) // 3
        self.executor.insert_rows(self._kv(dst), self._kv(src), rest[:n], rest[n : 2 * n], rest[2 * n :])

    def _save_blocks(self, ints: list[int], _: mx.array) -> None:
        src, block_tokens, first, n, *rest = ints
        for i, block in enumerate(self.executor.save_blocks(self._kv(src), rest[:n], rest[n:], block_tokens)):
            self._put(first + i, block)

    def _gather(self, ints: list[int], _: mx.array) -> None:
        handle, capacity, *blocks = ints
        arrays = [cast(mx.array, self.store[b]) for b in blocks]
        self._put(handle, self.executor.gather_blocks(arrays, capacity))

    def _warm(self, ints: list[int], _: mx.array) -> None:
        phase, batch, size, capacity, repeats = ints
        self.executor.warm(MODEL_PHASES[phase], batch, size, capacity, repeats)
