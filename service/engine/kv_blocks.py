"""The block copies behind the prefix cache, as plain array functions: a prompt's new blocks
copied out of a cache row (:func:`copy_blocks`), and a hit's blocks joined into a staging cache
(:func:`join_blocks`). Each is one process's arrays; a pipeline group runs them on every rank
through the executor (:mod:`service.engine.executor`, :mod:`service.engine.group`)."""

from __future__ import annotations

import mlx.core as mx

from models.kv_cache import KVCache


def copy_blocks(kv: KVCache, rows: list[int], starts: list[int], block_tokens: int) -> list[mx.array]:
    """For each row r of ``rows`` and then each start s of ``starts`` (ascending), positions [s,
    s + block_tokens) of row r of the per-layer cache ``kv`` [B, Hkv, C, D], as one array
    [layers, 2 (keys, values), Hkv, block_tokens, D] that shares no buffer with ``kv`` once
    evaluated (lazy; ``len(rows) * len(starts)`` arrays, row-major).

    The span from the first to the last block is gathered once for all the rows (one copy per
    layer and one stack), then each block is one contiguous copy of its part: on a GPU every
    copy is a kernel launch, and slicing each block from each layer's cache would be ``2 *
    layers`` launches per block (over 11,000 for a 6,000-token prompt).
    """
    lo, hi = starts[0], starts[-1] + block_tokens
    if len(rows) == 1:
        r = rows[0]
        pick = lambda a: a[r : r + 1, :, lo:hi]  # noqa: E731
    else:
        index = mx.array(rows, mx.int32)
        pick = lambda a: mx.take(a[:, :, lo:hi], index, axis=0)  # noqa: E731
    span = mx.stack([mx.stack([pick(k), pick(v)]) for k, v in zip(kv.keys, kv.values, strict=True)])
    return [mx.contiguous(span[:, :, u, :, s - lo : s - lo + block_tokens]) for u in range(len(rows)) for s in starts]


_ZERO_BLOCKS: dict[tuple[tuple[int, ...], mx.Dtype], mx.array] = {}


def _zero_block(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """One evaluated block of zeros per shape and dtype, kept: a padded concatenation then reads
    it as it reads the blocks, with no fill of its own, so the counts padded to a power of two
    and that power itself run the same kernels."""
    key = (tuple(shape), dtype)
    if key not in _ZERO_BLOCKS:
        zeros = mx.zeros(shape, dtype)
        mx.eval(zeros)
        _ZERO_BLOCKS[key] = zeros
    return _ZERO_BLOCKS[key]


def padded_block_count(count: int, limit: int) -> int:
    """``count`` blocks rounded up to a power of two, but to no more than ``limit`` (the blocks
    a staging cache holds) nor fewer than ``count``."""
    return max(count, min(1 << (count - 1).bit_length(), limit))


def join_blocks(blocks: list[mx.array], capacity: int | None = None) -> KVCache:
    """Blocks [layers, 2, Hkv, block_tokens, D] (in prompt order) as a batch-1 cache: per layer
    [1, Hkv, capacity or their total positions, D] (lazy; zero-padded up to ``capacity``).

    The blocks are concatenated once, then each layer's keys and values are copied into a
    zeroed buffer of their own, laid out as a cache from :meth:`KVCache.allocate` is. Views
    into the one concatenation would save those copies, but the compiled chunk step's attention
    on CUDA (cuDNN) builds its plan for the layout of its inputs: a hit's first chunk at each
    (T, C) then built a second one, under a request, that warm-up (on zeroed caches) never ran.

    The concatenation takes :func:`padded_block_count` inputs, the blocks then zero blocks: on
    CUDA it is one copy per input, and MLX builds a CUDA graph the first time it meets a new
    sequence of kernels, so each new block count built one under a request; padded, the counts
    up to a power of two share one.
    """
    block_tokens = blocks[0].shape[3]
    positions = len(blocks) * block_tokens
    capacity = max(capacity or positions, positions)
    pad = padded_block_count(len(blocks), capacity // block_tokens) - len(blocks)
    if pad:
        blocks = [*blocks, *[_zero_block(blocks[0].shape, blocks[0].dtype)] * pad]
    full = mx.concatenate(blocks, axis=3)  # [layers, 2, Hkv, padded positions, D]
    layers, _, heads, positions, dim = full.shape
    at = mx.array([0, 0, 0, 0], mx.int32)

    def own(part: mx.array) -> mx.array:  # [Hkv, positions, D] -> [1, Hkv, capacity, D], a buffer of its own
        zeros = mx.zeros((1, heads, capacity, dim), full.dtype)
        return mx.slice_update(zeros, part[None], at, (0, 1, 2, 3))

    return KVCache([own(full[layer, 0]) for layer in range(layers)], [own(full[layer, 1]) for layer in range(layers)])
