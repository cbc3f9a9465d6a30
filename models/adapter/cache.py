"""The per-layer cache objects an unmodified mlx-lm module sees inside a compiled step.

mlx-lm's modules talk to their caches through a small protocol (``mlx_lm.models.cache``):
attention layers read ``cache.offset`` as the RoPE offset, call ``update_and_fetch(keys,
values)`` and build masks with ``make_mask`` (through ``base.create_attention_mask``);
recurrent layers index an ``ArraysCache`` (``cache[0]``, ``cache[1] = ...``), read its
``lengths`` and call ``advance``. mlx-lm's own caches grow by concatenation and keep a Python
int offset, so one compiled function cannot serve them at a fixed shape. The classes here speak
the same protocol over fixed buffers with per-row positions as arrays:

- :class:`SlotKVCache`: keys and values [B, Hkv, S, D] (a bucket's rows and capacity), the
  offset an int32 [B] array (each row's next position), writes and masks by
  :func:`models.attention.cache_layout` (linear, or a ring of S <= W positions for a sliding
  layer in decode);
- :class:`QuantizedSlotKVCache`: the same over quantized keys and values (``kv_bits``: a paged
  pool's quantized view), in the protocol of mlx-lm's ``QuantizedKVCache``;
- :class:`SlotStateCache`: mlx-lm's ``ArraysCache`` (so the modules' ``isinstance`` checks
  pass) whose arrays [B, ...] come in and go out of the step;
- mlx-lm's ``CacheList`` holding these, for layers with several caches;
- :class:`UnusedCache` for a cache entry a layer never writes (it raises on any use).

Shapes: B rows, L new tokens per row, S a layer's buffer positions, Hkv key-value heads, Dk and
Dv the key and value head dims (they differ in multi-head latent attention).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from models.adapter.layout import UnsupportedCache
from models.attention import cache_layout, write_prefix
from models.paged import Quantized


class SlotKVCache:
    """One attention layer's keys and values in a bucket's fixed buffers, in mlx-lm's cache
    protocol (``offset``, ``update_and_fetch``, ``make_mask``, ``state``).

    Args:
        keys: [B, Hkv, S, Dk], the layer's key buffer.
        values: [B, Hkv, S, Dv], its value buffer.
        offset: int32 [B], each row's position of its first new token (mlx-lm's ``offset``,
            the RoPE offset: ``mx.fast.rope`` takes one offset per row).
        window: the layer's sliding window in positions (from the model's own
            ``RotatingKVCache``), or None for full attention.
        prefix: the step writes every row from position 0 over the whole buffer (prefill:
            L == S, offsets all 0), so a write is a copy rather than a scatter.
        grouped: masks get a query-group axis, [B, 1, 1, N, S], for a module whose attention
            scores are [B, Hkv, repeats, N, S] (mlx-lm's gemma2 with grouped queries).
    """

    def __init__(
        self,
        keys: mx.array,
        values: mx.array,
        offset: mx.array,
        window: int | None = None,
        prefix: bool = False,
        grouped: bool = False,
    ):
        self.keys, self.values = keys, values
        self.offset = offset.astype(mx.int32)  # an array of its own: a module may add to it in place
        self.window, self.prefix, self.grouped = window, prefix, grouped

    def _positions(self, n: int) -> mx.array:
        """int32 [B, n]: the positions of each row's next n tokens."""
        return self.offset[:, None] + mx.arange(n, dtype=mx.int32)[None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write each row's L new keys [B, Hkv, L, Dk] and values [B, Hkv, L, Dv] at its
        positions offset..offset+L-1 (a ring: position mod S, L == 1), advance the offset by L
        and return the whole buffers [B, Hkv, S, D] (the mask hides what a query may not see)."""
        L = keys.shape[2]
        if self.prefix and L == self.keys.shape[2]:
            self.keys, self.values = write_prefix(self.keys, keys), write_prefix(self.values, values)
        else:
            index, _ = cache_layout(self._positions(L), self.window, self.keys.shape[2])
            self.keys = _scatter(self.keys, index, keys)
            self.values = _scatter(self.values, index, values)
        self.offset = self.offset + L
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """bool [B, 1, N, S] ([B, 1, 1, N, S] when ``grouped``): which buffer indices each of
        the next N queries of each row sees (:func:`models.attention.cache_layout`;
        ``window_size`` overrides the layer's window). Always an array, whatever
        ``return_array`` says: mlx-lm's ``None`` and ``"causal"`` hold only when the keys are
        exactly the filled positions, never in a fixed buffer."""
        window = window_size if window_size is not None else self.window
        return _mask(self._positions(N), window, self.keys.shape[2], self.grouped)

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """The whole buffers [B, Hkv, S, Dk] and [B, Hkv, S, Dv]."""
        return self.keys, self.values

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """(keys, values), the buffers."""
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        """Bytes of both buffers."""
        return self.keys.nbytes + self.values.nbytes

    def size(self) -> int:
        """S, the positions the buffer holds."""
        return self.keys.shape[2]

    def empty(self) -> bool:
        """Never: the buffers exist from the start."""
        return False

    def is_trimmable(self) -> bool:
        """No: a step rolls back by position alone (the caller passes earlier positions)."""
        return False


class QuantizedSlotKVCache:
    """One attention layer's quantized keys and values (``kv_bits``) in fixed buffers, in the
    protocol of mlx-lm's ``QuantizedKVCache`` (``mlx_lm.models.cache``): ``update_and_fetch``
    takes full-precision keys and values and returns (packed, scales, biases) triples, and
    the ``bits`` and ``group_size`` attributes make mlx-lm's ``base.scaled_dot_product_attention``
    attend with its ``quantized_scaled_dot_product_attention`` (``mx.quantized_matmul`` over
    the triples, nothing dequantized). A module whose attention reads the keys any other way
    gets a tuple and fails (:func:`models.adapter.steps.quantized_attention_error` finds it).

    Layout: each buffer is the triple ``mx.quantize`` returns for [B, Hkv, S, D] (affine, one
    scale and bias per ``group_size`` values of D; MLX's ``mx.quantize``): packed uint32
    [B, Hkv, S, D * bits / 32], scales and biases [B, Hkv, S, D / group_size] in the compute
    dtype, mlx-lm's ``QuantizedKVCache`` layout at a fixed S (a paged step's gathered view,
    :func:`models.paged.gather_quantized`).

    Args:
        keys: the layer's key triple. values: its value triple.
        offset: int32 [B], each row's position of its first new token (as :class:`SlotKVCache`).
        bits: 4 or 8. group_size: values of D per scale and bias (64, mlx-lm's default).
        window: the layer's sliding window in positions, or None (full attention).
        grouped: masks [B, 1, 1, N, S] (as :class:`SlotKVCache`).
    """

    def __init__(
        self,
        keys: Quantized,
        values: Quantized,
        offset: mx.array,
        bits: int,
        group_size: int,
        window: int | None = None,
        grouped: bool = False,
    ):
        self.keys, self.values = keys, values
        self.offset = offset.astype(mx.int32)  # an array of its own: a module may add to it in place
        self.bits, self.group_size = bits, group_size
        self.window, self.grouped = window, grouped

    def _positions(self, n: int) -> mx.array:
        """int32 [B, n]: the positions of each row's next n tokens."""
        return self.offset[:, None] + mx.arange(n, dtype=mx.int32)[None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        """Quantize each row's L new keys [B, Hkv, L, Dk] and values [B, Hkv, L, Dv] (cast to
        the scales' dtype first, as the pool stores them), write each part at the rows'
        positions offset..offset+L-1 (:func:`models.attention.cache_layout`), advance the
        offset by L and return the whole triples [B, Hkv, S, *].

        Raises:
            ValueError: (``mx.quantize``) a head dim that is not a multiple of ``group_size``.
        """
        L = keys.shape[2]
        index, _ = cache_layout(self._positions(L), self.window, self.size())
        self.keys = self._write(self.keys, index, keys)
        self.values = self._write(self.values, index, values)
        self.offset = self.offset + L
        return self.keys, self.values

    def _write(self, buffer: Quantized, index: mx.array, new: mx.array) -> Quantized:
        """``buffer`` with ``new`` [B, Hkv, L, D] quantized and each part written at ``index``
        int32 [B, 1, L, 1] along S."""
        parts = mx.quantize(new.astype(buffer[1].dtype), group_size=self.group_size, bits=self.bits)
        packed, scales, biases = (_scatter(b, index, n) for b, n in zip(buffer, parts, strict=True))
        return packed, scales, biases

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """As :meth:`SlotKVCache.make_mask`: bool [B, 1, N, S] (grouped: [B, 1, 1, N, S])."""
        window = window_size if window_size is not None else self.window
        return _mask(self._positions(N), window, self.size(), self.grouped)

    def keys_and_values(self) -> tuple[Quantized, Quantized]:
        """The whole triples."""
        return self.keys, self.values

    @property
    def state(self) -> tuple[Quantized, Quantized]:
        """(keys, values), the triples."""
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        """Bytes of both triples."""
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def size(self) -> int:
        """S, the positions the buffers hold."""
        return self.keys[0].shape[2]

    def empty(self) -> bool:
        """Never: the buffers exist from the start."""
        return False

    def is_trimmable(self) -> bool:
        """No: a step rolls back by position alone."""
        return False


class UnusedCache:
    """The cache object of a layer whose mlx-lm cache stayed empty in the layout probe
    (:class:`models.adapter.layout.UnusedLayout`): the module may hold and pass it, and any
    use of it raises, so a layer that does write a cache after all fails loudly."""

    def __getattr__(self, name: str):
        raise UnsupportedCache(f"a layer used the cache ({name!r}) it left empty in the layout probe")


class SlotStateCache(ArraysCache):
    """One recurrent layer's state arrays [B, ...] as mlx-lm's ``ArraysCache``: the layer reads
    ``cache[i]`` and assigns ``cache[i] = new``; the step passes the arrays in and collects
    them after.

    Args:
        states: the layer's arrays, each [B, ...]; None entries (a prefill) let the module
            start from its own initial state, as mlx-lm does with a fresh cache.
        lengths: int32 [B], each row's real tokens in a right-padded step (the modules that
            honour it mask the padding and keep each row's state at its last real token), or
            None (decode: every row has exactly one token).
    """

    def __init__(self, states: list[mx.array | None], lengths: mx.array | None = None):
        super().__init__(len(states))
        self.cache = list(states)
        # An array of its own: mlx-lm's ``advance`` subtracts in place, and one lengths array
        # serves every layer of a step (and the step's own last-token lookup).
        self.lengths = None if lengths is None else lengths.astype(mx.int32)

    def empty(self) -> bool:
        """Whether the first array is still unset (a fresh prefill)."""
        return self.cache[0] is None


def _mask(positions: mx.array, window: int | None, size: int, grouped: bool) -> mx.array:
    """bool [B, 1, N, size] ([B, 1, 1, N, size] when ``grouped``): which buffer indices the
    queries at ``positions`` int32 [B, N] see (:func:`models.attention.cache_layout`)."""
    _, mask = cache_layout(positions, window, size)
    return mask[:, :, None] if grouped else mask


def _scatter(buf: mx.array, index: mx.array, new: mx.array) -> mx.array:
    """buf [B, H, S, D] with new [B, H, L, D] written at index int32 [B, 1, L, 1] along S."""
    return mx.put_along_axis(buf, mx.broadcast_to(index, new.shape), new.astype(buf.dtype), axis=2)
