"""A static, preallocated KV cache: one keys and one values buffer per layer.

Every buffer has the shape [B, Hkv, S, D]: B rows (a batch bucket), Hkv key-value heads,
S positions and D the head dim. S is the capacity C (a capacity bucket) for every layer of a
linear cache; in a decode cache with ``windows``, a sliding-window layer of window W holds a
ring of min(W, C) positions instead (:mod:`models.attention`), so its memory stops growing
at the window. Step functions write into it at array indices and return a new cache (MLX
arrays are immutable values inside a compiled graph); the shapes never change inside a step,
so each (B, C) pair is one compiled shape.

A model with recurrent layers (Mamba-style SSMs, gated delta nets, short convolutions) also
carries ``states``: per-row arrays [B, ...] of fixed shape whatever the position, which rows
carry along (insert, reorder, batch resize) like their keys and values, and which a capacity
change leaves as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx

#: Per layer, its sliding window in positions, or None for a full-attention layer.
Windows = Sequence[int | None]


def layer_sizes(layers: int, capacity: int, windows: Windows | None) -> list[int]:
    """Positions each layer's buffer holds at ``capacity``: C, or min(W, C) for a sliding layer
    when ``windows`` is given (None: a linear cache, C for every layer)."""
    if windows is None:
        return [capacity] * layers
    return [capacity if w is None else min(w, capacity) for w in windows]


def ring_positions(length: int, size: int) -> list[int]:
    """The position each index 0..size-1 of a ring of ``size`` holds after positions
    0..length-1 were written at ``position mod size``: the latest such position, or 0 (an
    index not written yet, masked until it is) when there is none."""
    return [max(0, (length - 1) - ((length - 1 - s) % size)) for s in range(size)]


class KVCache(NamedTuple):
    """Per-layer key and value buffers, each [B, Hkv, C, D] (keys and values may differ in D),
    and recurrent states, each [B, ...] (a pytree MLX compilation accepts)."""

    keys: list[mx.array]
    values: list[mx.array]
    states: Sequence[mx.array] = ()

    @property
    def capacity(self) -> int:
        """C: positions per row (the largest layer's; ring layers hold fewer; 0 without keys)."""
        return max((k.shape[2] for k in self.keys), default=0)

    @property
    def batch(self) -> int:
        """B: rows (slots)."""
        return (self.keys or self.states)[0].shape[0]

    @property
    def dtype(self) -> mx.Dtype:
        return (self.keys or self.states)[0].dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers and states."""
        return sum(a.nbytes for a in (*self.keys, *self.values, *self.states))

    @staticmethod
    def allocate(
        layers: int,
        batch: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: mx.Dtype,
        windows: Windows | None = None,
    ) -> KVCache:
        """Zero-filled cache of ``layers`` x [batch, kv_heads, S, head_dim], S per
        :func:`layer_sizes` (``windows`` given: sliding layers as rings, for decode)."""
        sizes = layer_sizes(layers, capacity, windows)
        return KVCache(
            [mx.zeros((batch, kv_heads, s, head_dim), dtype) for s in sizes],
            [mx.zeros((batch, kv_heads, s, head_dim), dtype) for s in sizes],
        )

    def resized(self, capacity: int, windows: Windows | None = None) -> KVCache:
        """A copy at another capacity: each layer zero-padded when growing, truncated when
        shrinking, to its :func:`layer_sizes` size (``windows``: a decode cache's rings,
        which stay as they are once they hold their window).

        Truncation drops positions >= ``capacity``; callers shrink only below every live
        row's length (a ring shrunk below its window then holds positions at their own
        index, as it did before it wrapped). This is the one copy a bucket move costs.
        """
        sizes = layer_sizes(len(self.keys), capacity, windows)

        def fit(buf: mx.array, size: int) -> mx.array:
            have = buf.shape[2]
            if size == have:
                return buf
            if size < have:
                return buf[:, :, :size]
            return mx.pad(buf, [(0, 0), (0, 0), (0, size - have), (0, 0)])

        return KVCache(
            [fit(k, s) for k, s in zip(self.keys, sizes, strict=True)],
            [fit(v, s) for v, s in zip(self.values, sizes, strict=True)],
            self.states,
        )

    def reordered(self, rows: list[int]) -> KVCache:
        """A copy whose row i is row ``rows[i]`` of this cache (one gather per buffer)."""
        order = mx.array(rows, mx.int32)
        return KVCache([k[order] for k in self.keys], [v[order] for v in self.values], [s[order] for s in self.states])

    def batch_resized(self, batch: int) -> KVCache:
        """This cache padded with empty (zero) rows, or cut, to ``batch`` rows."""
        if batch < self.batch:
            return KVCache(
                [k[:batch] for k in self.keys], [v[:batch] for v in self.values], [s[:batch] for s in self.states]
            )

        def pad(a: mx.array) -> mx.array:
            return mx.pad(a, [(0, batch - self.batch)] + [(0, 0)] * (a.ndim - 1))

        return KVCache([pad(k) for k in self.keys], [pad(v) for v in self.values], [pad(s) for s in self.states])

    def insert_row(self, slot: int, src: KVCache, row: int, length: int) -> None:
        """Copy row ``row`` of a linear cache ``src`` (a prefill or staging cache holding
        positions 0..length-1) into row ``slot`` of this cache, in place (the buffers' list
        entries are replaced). A layer of this cache smaller than ``length`` is a ring
        (the decode cache's sliding layers): it gets each index's latest position
        (:func:`ring_positions`); every other layer gets positions 0..S-1 (zero-padded).
        Each recurrent state gets the source row's (its state after position length-1).

        Raises:
            ValueError: ``src`` holds fewer than ``length`` positions.
        """
        if self.keys and src.capacity < length:
            raise ValueError(f"the source cache holds {src.capacity} positions, fewer than the row's {length}")
        for layer, (keys, values) in enumerate(zip(src.keys, src.values, strict=True)):
            size = self.keys[layer].shape[2]
            if length > size:  # a ring that has wrapped: gather each index's latest position
                index = mx.array(ring_positions(length, size), mx.int32)
                self.keys[layer][slot] = keys[row][:, index]
                self.values[layer][slot] = values[row][:, index]
                continue
            self.keys[layer][slot] = _fit_positions(keys[row], size)
            self.values[layer][slot] = _fit_positions(values[row], size)
        for state, source in zip(self.states, src.states, strict=True):
            state[slot] = source[row]

    def insert_rows(self, slots: list[int], src: KVCache, rows: list[int], lengths: list[int]) -> None:
        """Copy rows ``rows`` of a linear cache ``src`` (row i holding positions
        0..lengths[i]-1) into rows ``slots`` of this cache, in place, with one indexed copy per
        layer for the rows that fit a layer linearly (on a GPU each copy is a kernel launch).
        Only the first ``min(src.capacity, S)`` positions of a layer of S are written: the rest
        of a slot keeps whatever it held, which attention masks by position. A ring layer that
        a row has wrapped gets that row's latest positions, as in :meth:`insert_row`. Each
        recurrent state gets its source rows' (one indexed copy per state).

        Raises:
            ValueError: ``src`` holds fewer positions than some row's length.
        """
        if self.keys and src.capacity < max(lengths):
            raise ValueError(f"the source cache holds {src.capacity} positions, fewer than a row's {max(lengths)}")
        for layer, (keys, values) in enumerate(zip(src.keys, src.values, strict=True)):
            size = self.keys[layer].shape[2]
            linear = [i for i, length in enumerate(lengths) if length <= size]
            if linear:
                n = min(src.capacity, size)
                dst, at = _index([slots[i] for i in linear]), _index([rows[i] for i in linear])
                self.keys[layer][dst, :, :n] = keys[at, :, :n]
                self.values[layer][dst, :, :n] = values[at, :, :n]
            for i in (i for i, length in enumerate(lengths) if length > size):  # wrapped rings
                index = mx.array(ring_positions(lengths[i], size), mx.int32)
                self.keys[layer][slots[i]] = keys[rows[i]][:, index]
                self.values[layer][slots[i]] = values[rows[i]][:, index]
        if self.states:
            dst, at = _index(slots), _index(rows)
            for state, source in zip(self.states, src.states, strict=True):
                state[dst] = source[at]


def _index(rows: list[int]) -> slice | mx.array:
    """Rows as an index: a slice when they are consecutive (a plain copy), else an int32 array."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return mx.array(rows, mx.int32)


def _fit_positions(buf: mx.array, size: int) -> mx.array:
    """buf [Hkv, S, D] cut or zero-padded to [Hkv, size, D]."""
    have = buf.shape[1]
    if size <= have:
        return buf[:, :size]
    return mx.pad(buf, [(0, 0), (0, size - have), (0, 0)])
