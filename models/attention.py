"""Attention and KV-cache writes for the step functions, per layer kind: full (causal over
every position) or sliding-window (a query at position p sees keys at p - W + 1 .. p,
Beltagy et al. 2020, "Longformer"; Mistral's and Gemma's local layers), over a linear cache
(position p at index p) or a ring (position p at index p mod S, decode only).

Which layout a layer's buffer has follows from its static shape, so a traced step needs no
flag: a sliding layer whose buffer holds S <= W positions is a ring (while positions < S the
two layouts coincide, so a linear prefill cache of S <= W positions is read the same way); a
buffer of S > W positions, or any full layer's, is linear. The runner gives sliding layers a
ring of min(W, C) positions in the decode cache (:meth:`models.kv_cache.KVCache.allocate`), so
their memory stops growing at the window; prefill and chunk caches stay linear.

Shapes: B rows, L new tokens per row (decode L = 1), T prompt bucket, S a layer's cache
positions, Hq/Hkv query/key-value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

#: One layer's attention and cache update: (q [B, Hq, L, D], k and v [B, Hkv, L, D] after RoPE,
#: the layer's cache keys and values [B, Hkv, S, D]) -> (output [B, Hq, L, D], new keys, new values).
Attend = Callable[[mx.array, mx.array, mx.array, mx.array, mx.array], tuple[mx.array, mx.array, mx.array]]


def is_ring(window: int | None, size: int) -> bool:
    """Whether a layer's buffer of ``size`` positions is read as a ring: it is a sliding layer
    (``window`` not None) and holds at most its window."""
    return window is not None and size <= window


def write_prefix(buf: mx.array, new: mx.array) -> mx.array:
    """Write new [B, Hkv, T, D] into buf [B, Hkv, S, D] at positions 0..T-1 (S >= T)."""
    T, S = new.shape[2], buf.shape[2]
    if T == S:
        return new.astype(buf.dtype)
    return mx.concatenate([new.astype(buf.dtype), buf[:, :, T:, :]], axis=2)


def kv_roundtrip(x: mx.array, bits: int, group_size: int = 64) -> mx.array:
    """``x`` [..., D] as a ``kv_bits`` pool keeps it: quantized per ``group_size`` values of D
    (``mx.quantize``, affine, mlx-lm's ``QuantizedKVCache`` layout) and dequantized, in ``x``'s
    dtype. A staging cache holding these values attends as the pool's quantized attention does
    (to float32 rounding), and the pool quantizes them back to the same codes."""
    return mx.dequantize(*mx.quantize(x, group_size=group_size, bits=bits), group_size=group_size, bits=bits).astype(
        x.dtype
    )


class PromptAttention:
    """Prefill's attention: causal within the prompt (positions 0..T-1, right-padded rows:
    a real query only sees earlier, real keys), restricted to the window for sliding layers;
    keys and values written at cache positions 0..T-1 (a cache of S >= T positions: linear,
    or a ring of S <= W, where positions below S sit at their own index too).

    Args:
        T: the prompt bucket.
        scale: the attention scale (1/sqrt(D) unless the model says otherwise).
        bits, group_size: a ``kv_bits`` pool's quantization: keys and values are attended and
            written as it keeps them (:func:`kv_roundtrip`); None: full precision.
    """

    def __init__(self, T: int, scale: float, bits: int | None = None, group_size: int = 64):
        self.T, self.scale, self.bits, self.group_size = T, scale, bits, group_size
        self._masks: dict[int, mx.array] = {}

    def __call__(self, window: int | None) -> Attend:
        """The :data:`Attend` of a layer with sliding ``window`` (None: full attention)."""
        mask: mx.array | str = "causal" if window is None or window >= self.T else self._window_mask(window)

        def attend(q, k, v, keys, values):
            if self.bits:  # a kv_bits pool's staging cache; nothing added to a full-precision step
                k, v = kv_roundtrip(k, self.bits, self.group_size), kv_roundtrip(v, self.bits, self.group_size)
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
            return o, write_prefix(keys, k), write_prefix(values, v)

        return attend

    def _window_mask(self, window: int) -> mx.array:
        if window not in self._masks:
            i, j = mx.arange(self.T)[:, None], mx.arange(self.T)[None, :]
            self._masks[window] = (j <= i) & (i - j < window)  # [T, T]
        return self._masks[window]


class CacheAttention:
    """Decode's and a prompt chunk's attention: row b's new keys and values scattered at its
    positions, then its queries attend over the whole cache, query l of row b masked to the
    positions it may see: 0..its own (full layers), its last W (sliding layers).

    Args:
        positions: int32 [B, L], each new token's position (a chunk: offset + 0..L-1; padded
            chunk tokens write garbage beyond the real ones, which later steps mask and
            overwrite).
        scale: the attention scale.
        bits, group_size: as :class:`PromptAttention`'s (a staging cache of a ``kv_bits`` pool).

    A linear buffer writes position p at index p; a ring (:func:`is_ring`) at p mod S and masks
    indices not yet written (index > p); every index it holds is within the window, since it
    holds the S <= W latest positions. Only decode (L = 1) reads a ring: a chunk's later tokens
    would overwrite keys its earlier tokens still see, so chunks go to linear staging caches.
    """

    def __init__(self, positions: mx.array, scale: float, bits: int | None = None, group_size: int = 64):
        self.positions, self.scale = positions.astype(mx.int32), scale
        self.bits, self.group_size = bits, group_size
        self._layouts: dict[tuple[int | str | None, int], tuple[mx.array, mx.array]] = {}

    def __call__(self, window: int | None) -> Attend:
        """The :data:`Attend` of a layer with sliding ``window`` (None: full attention)."""

        def attend(q, k, v, keys, values):
            if self.bits:  # a kv_bits pool's staging cache; nothing added to a full-precision step
                k, v = kv_roundtrip(k, self.bits, self.group_size), kv_roundtrip(v, self.bits, self.group_size)
            index, mask = self._layout(window, keys.shape[2])
            keys = mx.put_along_axis(keys, mx.broadcast_to(index, k.shape), k.astype(keys.dtype), axis=2)
            values = mx.put_along_axis(values, mx.broadcast_to(index, v.shape), v.astype(values.dtype), axis=2)
            o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
            return o, keys, values

        return attend

    def _layout(self, window: int | None, size: int) -> tuple[mx.array, mx.array]:
        """:func:`cache_layout` of this step's positions for a buffer of ``size``, computed once
        per (layout, size) and shared by the layers that have it."""
        ring = is_ring(window, size) and self.positions.shape[1] == 1
        key = ("ring", size) if ring else (window, size)
        if key not in self._layouts:
            self._layouts[key] = cache_layout(self.positions, window, size)
        return self._layouts[key]


def cache_layout(positions: mx.array, window: int | None, size: int) -> tuple[mx.array, mx.array]:
    """Where new tokens go in one layer's buffer and which indices their queries see.

    Args:
        positions: int32 [B, L], each new token's position.
        window: the layer's sliding window in positions, or None (full attention).
        size: S, the positions the layer's buffer holds.

    Returns:
        (write index int32 [B, 1, L, 1], mask bool [B, 1, L, S]). A buffer read as a ring
        (:func:`is_ring`, and one token per row: decode) writes position p at p mod S and masks
        the indices not written yet (index > p); any other buffer is linear: p at index p, query
        l of row b seeing indices 0..p (full) or p - W + 1..p (sliding, Beltagy et al. 2020).

    Several tokens per row (a chunk) always use the linear layout: a chunk is written into
    a linear staging cache whose positions are all below its size (the caller's contract),
    where a ring of S <= W would read the same anyway.
    """
    p = positions.astype(mx.int32)  # [B, L]
    ring = is_ring(window, size) and p.shape[1] == 1
    j = mx.arange(size)[None, None, :]  # [1, 1, S]
    mask = j <= p[:, :, None]  # [B, L, S]: written already (ring) or causal (linear)
    if window is not None and not ring:
        mask = mask & (p[:, :, None] - j < window)
    index = p % size if ring else p
    return index[:, None, :, None], mask[:, None, :, :]
