"""Paged KV: one layer's keys and values in a pool of fixed-size blocks, read and written
through per-row block tables, in portable MLX ops (correct on the CPU, traceable by
``mx.compile`` with the tables and positions as int32 array inputs).

Layout: a layer's pool is keys and values of [num_blocks, Hkv, block_tokens, D] each. Block-major
because a block is then one contiguous slab per layer: a copy-on-write is one slice copy per
layer, a block's quantized storage is its own, and block n of the pool is laid out as one row
of :class:`models.kv_cache.KVCache` ([B, Hkv, S, D] with B -> blocks, S -> block_tokens), so the
prefix cache's per-layer blocks [Hkv, block_tokens, D] are exactly one pool entry. Heads before
positions, as in the static cache, so a gathered view is already the [B, Hkv, S, D] that
``mx.fast.scaled_dot_product_attention`` reads (vLLM puts positions before heads, for its
kernels; a portable path would then transpose every view).

A row's block table (int32 [B, M]) lists its blocks in position order: position p sits at offset
``p % block_tokens`` of block ``table[b, p // block_tokens]``. Columns past a row's blocks, and
padded rows, hold the null block (:data:`service.engine.block_pool.NULL_BLOCK`, 0): a padded
token's write lands there and attention masks it by position. Every position written must be
below ``M * block_tokens``: a column index past M is not checked (MLX gathers do not bound-check).

Shapes: B rows, L new tokens per row (decode L = 1), M table columns, Hq/Hkv query/key-value
heads, D head dim, N blocks, bt block_tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx

from models import paged_kernel
from models.attention import Attend, cache_layout

#: The block that padding writes go to (:data:`service.engine.block_pool.NULL_BLOCK`): never a
#: request's, and attention masks whatever it holds.
NULL_BLOCK = 0


class PagedKV(NamedTuple):
    """Per-layer key and value pools, each [num_blocks, Hkv, block_tokens, D], or with ``kv_bits``
    each a :data:`Quantized` triple of such pools (a pytree MLX compilation accepts)."""

    keys: list
    values: list

    @property
    def block_tokens(self) -> int:
        """Token positions per block."""
        return _first(self.keys[0]).shape[2]

    @property
    def num_blocks(self) -> int:
        return _first(self.keys[0]).shape[0]

    @property
    def quantized(self) -> bool:
        """Whether the pools are :data:`Quantized` triples (``kv_bits``)."""
        return isinstance(self.keys[0], tuple)

    @property
    def nbytes(self) -> int:
        """Bytes held by all pools."""
        return sum(
            a.nbytes for pool in (*self.keys, *self.values) for a in (pool if isinstance(pool, tuple) else [pool])
        )

    @staticmethod
    def allocate(
        layers: int,
        num_blocks: int,
        kv_heads: int,
        block_tokens: int,
        head_dim: int,
        dtype: mx.Dtype,
        bits: int | None = None,
        group_size: int = 64,
    ) -> PagedKV:
        """Zero-filled pools of ``layers`` x [num_blocks, kv_heads, block_tokens, head_dim], or
        with ``bits`` (4 or 8) quantized ones (:func:`quantized_pool`; raises ValueError as it)."""
        shape = (num_blocks, kv_heads, block_tokens, head_dim)
        if bits:
            pools = [
                quantized_pool(num_blocks, kv_heads, block_tokens, head_dim, bits, group_size, dtype)
                for _ in range(2 * layers)
            ]
            return PagedKV(pools[:layers], pools[layers:])
        return PagedKV([mx.zeros(shape, dtype) for _ in range(layers)], [mx.zeros(shape, dtype) for _ in range(layers)])

    def copied(self, src: mx.array, dst: mx.array) -> PagedKV:
        """The pools with blocks ``dst`` overwritten by blocks ``src`` in every layer (the block
        pool's copy-on-writes; int32 [n] each, ``dst`` distinct and disjoint from ``src``)."""

        def copy(pool):
            return (
                tuple(copy_blocks(p, src, dst) for p in pool)
                if isinstance(pool, tuple)
                else copy_blocks(pool, src, dst)
            )

        return PagedKV([copy(k) for k in self.keys], [copy(v) for v in self.values])


def _first(pool) -> mx.array:
    """A pool's array, or a quantized pool's packed part (its shape leads with [N, Hkv, bt])."""
    return pool[0] if isinstance(pool, tuple) else pool


def copy_blocks(pool: mx.array, src: mx.array, dst: mx.array) -> mx.array:
    """``pool`` [N, Hkv, bt, D] with block ``dst[i]`` holding block ``src[i]``'s contents
    (int32 [n] each; ``dst`` distinct, and no ``dst`` also a ``src``)."""
    out = mx.array(pool)
    out[dst] = pool[src]
    return out


class PagedIndex(NamedTuple):
    """Where one step's new tokens go in a layer's pool and which pool rows its rows' views
    read: the same for every layer of a step (the tables and positions are), so a step computes
    it once per pool shape and every layer's :func:`write` and :func:`gather` reuse it (a traced
    step would otherwise carry each layer's copy of the index arithmetic, replayed every step).

    Attributes:
        block: int32 [B, 1, L], the block of each new token (``table[b, p // bt]``).
        heads: int32 [1, Hkv, 1], the head index.
        offset: int32 [B, 1, L], each new token's offset in its block (``p % bt``).
        rows: int32 [B * Hkv * M * bt], the view's rows of the pool flattened to
            [N * Hkv * bt, D], in view order (row b, head h, position j).
        view: (B, Hkv, M * bt), the view's leading shape.
    """

    block: mx.array
    heads: mx.array
    offset: mx.array
    rows: mx.array
    view: tuple[int, int, int]


def paged_index(
    block_table: mx.array, positions: mx.array, heads: int, block_tokens: int, ends: mx.array | None = None
) -> PagedIndex:
    """The :class:`PagedIndex` of a step: ``block_table`` int32 [B, M], ``positions`` int32
    [B, L] (below M * block_tokens), for pools of ``heads`` KV heads and ``block_tokens``-token
    blocks.

    ``ends`` (int32 [B], optional): each row's end of real tokens (a prefill's offset + length).
    A token at or past it is padding: it is written into the null block (block 0) whatever its
    position, which may then reach past M * block_tokens (its table column is clamped), so a
    prefill's padding never lands in a block the row, another row or the prefix cache holds.
    """
    table, p, bt = block_table.astype(mx.int32), positions.astype(mx.int32), block_tokens
    B, M = table.shape
    if ends is None:
        block = mx.take_along_axis(table, p // bt, axis=1)[:, None, :]  # [B, 1, L]
    else:
        column = mx.minimum(p // bt, M - 1)  # a padded position past the table reads its last column
        real = p < ends.astype(mx.int32)[:, None]  # [B, L]
        block = mx.where(real, mx.take_along_axis(table, column, axis=1), NULL_BLOCK)[:, None, :]
    head = mx.arange(heads, dtype=mx.int32)
    offsets = mx.arange(bt, dtype=mx.int32)[None, None, None, :]  # [1, 1, 1, bt]
    rows = (table[:, None, :, None] * heads + head[None, :, None, None]) * bt + offsets  # [B, Hkv, M, bt]
    return PagedIndex(block, head[None, :, None], (p % bt)[:, None, :], rows.reshape(-1), (B, heads, M * bt))


def write(pool: mx.array, block_table: mx.array, positions: mx.array, new: mx.array) -> mx.array:
    """Scatter new keys or values into a layer's pool.

    Args:
        pool: [N, Hkv, bt, D].
        block_table: int32 [B, M].
        positions: int32 [B, L], each token's position (below M * bt).
        new: [B, Hkv, L, D], cast to the pool's dtype.

    Returns:
        The pool [N, Hkv, bt, D] with row b's token l at offset ``p % bt`` of block
        ``block_table[b, p // bt]`` (p = positions[b, l]). Two tokens writing one slot (padding
        into the null block) leave one of them there, unspecified which.
    """
    return write_at(pool, paged_index(block_table, positions, pool.shape[1], pool.shape[2]), new)


def write_at(pool: mx.array, index: PagedIndex, new: mx.array) -> mx.array:
    """:func:`write` through a step's precomputed :class:`PagedIndex`.

    One scatter indexed on the pool itself (block, head, offset), not on a reshaped view of it: a
    view shares the pool's buffer, so MLX could not donate it to the scatter and would copy the
    whole pool every step (MLX updates an input in place only when nothing else holds it).
    """
    pool[index.block, index.heads, index.offset] = new.astype(pool.dtype)  # index [B, Hkv, L]
    return pool


def gather(pool: mx.array, block_table: mx.array) -> mx.array:
    """The rows' transient view of a layer's pool: their blocks in table order.

    Args:
        pool: [N, Hkv, bt, D].
        block_table: int32 [B, M].

    Returns:
        [B, Hkv, M * bt, D]: index j of row b is position j (block ``table[b, j // bt]``, offset
        ``j % bt``), laid out as a static cache row of capacity M * bt (one gather).
    """
    return gather_at(pool, view_index(block_table, pool.shape[1], pool.shape[2]))


def view_index(block_table: mx.array, heads: int, block_tokens: int) -> PagedIndex:
    """A :class:`PagedIndex` for reading only (:func:`gather_at`): ``block_table`` int32 [B, M]
    for pools of ``heads`` KV heads and ``block_tokens``-token blocks; its write fields name
    position 0 of each row."""
    return paged_index(block_table, mx.zeros((block_table.shape[0], 1), mx.int32), heads, block_tokens)


def gather_at(pool: mx.array, index: PagedIndex) -> mx.array:
    """:func:`gather` through a step's precomputed :class:`PagedIndex`: [B, Hkv, M * bt, *]."""
    N, H, bt = pool.shape[:3]
    flat = pool.reshape(N * H * bt, *pool.shape[3:])
    return mx.take(flat, index.rows, axis=0).reshape(*index.view, *pool.shape[3:])


class PagedAttention:
    """Attention over a paged KV pool, as :class:`models.attention.CacheAttention` over a static
    cache: each row's new keys and values written at its positions through its block table, then
    its queries attend over the gathered view, query l of row b seeing positions 0..its own
    (full layers) or its last W (sliding layers, Beltagy et al. 2020).

    Args:
        block_table: int32 [B, M], each row's blocks (null-block padded).
        positions: int32 [B, L], each new token's position (below M * bt; decode: L = 1, a
            chunk: offset + 0..L-1).
        scale: the attention scale.
        ends: int32 [B] or None: each row's end of real tokens (a prefill's offset + length).
            A token at or past it is padding: written into the null block
            (:func:`paged_index`), and its query attends as the row's last real token does,
            so no query's mask is empty (a sliding layer's window could otherwise hold no
            position of the view, and an empty softmax row is NaN, which would then be written).

    The view is linear (index j holds position j), so the mask is
    :func:`models.attention.cache_layout`'s for a buffer of M * bt positions: every position a
    row has written is below that size, where a ring's mask and a linear one agree. Nothing
    frees a sliding layer's blocks behind its window here; the mask alone keeps them unseen.

    A decode step (one query per row, ``ends`` None) on MLX's CUDA back-end skips the view:
    :func:`models.paged_kernel.decode_attention` reads the pool through the table (where
    :func:`models.paged_kernel.applies`), with the same answer.
    """

    def __init__(self, block_table: mx.array, positions: mx.array, scale: float, ends: mx.array | None = None):
        self.block_table, self.positions = block_table.astype(mx.int32), positions.astype(mx.int32)
        self.scale, self.ends = scale, None if ends is None else ends.astype(mx.int32)
        self._masks: dict[tuple[int | None, int], mx.array] = {}
        self._indices: dict[tuple[int, int], PagedIndex] = {}

    def __call__(self, window: int | None) -> Attend:
        """The :data:`models.attention.Attend` of a layer with sliding ``window`` (None: full
        attention), whose "keys" and "values" are the layer's pools [N, Hkv, bt, D]."""

        def attend(q, k, v, keys, values):
            index = self.index(keys.shape[1], keys.shape[2])
            keys, values = write_at(keys, index, k), write_at(values, index, v)
            if self.ends is None and paged_kernel.applies(q, keys):  # a decode step on a CUDA GPU
                at = self.positions[:, 0]
                o = paged_kernel.decode_attention(q, keys, values, self.block_table, at, self.scale, window)
                return o, keys, values
            view_k, view_v = gather_at(keys, index), gather_at(values, index)
            mask = self.mask(window, view_k.shape[2])
            o = mx.fast.scaled_dot_product_attention(q, view_k, view_v, scale=self.scale, mask=mask)
            return o, keys, values

        return attend

    def index(self, heads: int, block_tokens: int) -> PagedIndex:
        """This step's :class:`PagedIndex` for pools of ``heads`` KV heads and ``block_tokens``
        positions per block, computed once and shared by the layers that have that shape."""
        if (heads, block_tokens) not in self._indices:
            self._indices[(heads, block_tokens)] = paged_index(
                self.block_table, self.positions, heads, block_tokens, self.ends
            )
        return self._indices[(heads, block_tokens)]

    def mask(self, window: int | None, size: int) -> mx.array:
        """Which view indices each query sees: bool [B, 1, L, size] for a view of ``size``
        positions, computed once per (window, size) and shared by the layers."""
        if (window, size) not in self._masks:
            seen = self.positions if self.ends is None else mx.minimum(self.positions, self.ends[:, None] - 1)
            self._masks[(window, size)] = cache_layout(seen, window, size)[1]
        return self._masks[(window, size)]


#: A quantized pool or view: (packed uint32 [..., D * bits / 32], scales [..., D / group_size],
#: biases [..., D / group_size]), the triple ``mx.quantize`` returns and mlx-lm's
#: ``QuantizedKVCache`` stores.
Quantized = tuple[mx.array, mx.array, mx.array]


def quantized_pool(
    num_blocks: int, kv_heads: int, block_tokens: int, head_dim: int, bits: int, group_size: int, dtype: mx.Dtype
) -> Quantized:
    """A zero-filled quantized pool for ``kv_bits`` storage: packed uint32 [N, Hkv, bt, D * bits
    / 32], scales and biases [N, Hkv, bt, D / group_size] in ``dtype`` (mlx-lm's
    ``QuantizedKVCache`` layout, per block instead of per row).

    Raises:
        ValueError: ``head_dim`` is not a multiple of ``group_size`` or ``bits`` is not 4 or 8.
    """
    if bits not in (4, 8) or head_dim % group_size:
        raise ValueError(
            f"kv_bits = {bits}: quantized KV needs 4 or 8 bits and a head dim divisible by the group size "
            f"({group_size}); this model's head dim is {head_dim}: remove kv_bits"
        )
    shape = (num_blocks, kv_heads, block_tokens)
    return (
        mx.zeros((*shape, head_dim * bits // 32), mx.uint32),
        mx.zeros((*shape, head_dim // group_size), dtype),
        mx.zeros((*shape, head_dim // group_size), dtype),
    )


def write_quantized(pool: Quantized, index: PagedIndex, new: mx.array, bits: int, group_size: int) -> Quantized:
    """:func:`write_at` for a quantized pool: ``new`` [B, Hkv, L, D] quantized per
    ``group_size`` values of D (``mx.quantize``, affine), each part scattered at ``index``."""
    parts = mx.quantize(new.astype(pool[1].dtype), group_size=group_size, bits=bits)
    packed, scales, biases = (write_at(p, index, n) for p, n in zip(pool, parts, strict=True))
    return packed, scales, biases


def gather_quantized(pool: Quantized, index: PagedIndex) -> Quantized:
    """:func:`gather_at` of each part of a quantized pool: views [B, Hkv, M * bt, *]."""
    packed, scales, biases = (gather_at(p, index) for p in pool)
    return packed, scales, biases


#: :data:`models.attention.Attend` over quantized pools: (q, k, v, the layer's key and value
#: pools) -> (output [B, Hq, L, D], new key pool, new value pool).
QuantizedAttend = Callable[[mx.array, mx.array, mx.array, Quantized, Quantized], tuple[mx.array, Quantized, Quantized]]


class QuantizedPagedAttention:
    """:class:`PagedAttention` over quantized pools (``kv_bits``): new keys and values are
    quantized as they are written, and the queries attend over the quantized view with
    mlx-lm's ``quantized_scaled_dot_product_attention`` (``mx.quantized_matmul`` for the scores
    and the weighted values), so nothing is dequantized to a full-precision view.

    A prefill chunk's queries (``ends`` given) attend over the chunk's own keys and values
    quantized, as they are written, as mlx-lm's ``QuantizedKVCache`` has a prompt attend over
    its own quantized keys.

    Args:
        block_table, positions, scale, ends: as :class:`PagedAttention`.
        bits: 4 or 8. group_size: values of D per scale and bias (64 as mlx-lm's default).
    """

    def __init__(
        self,
        block_table: mx.array,
        positions: mx.array,
        scale: float,
        bits: int,
        group_size: int = 64,
        ends: mx.array | None = None,
    ):
        self.paged = PagedAttention(block_table, positions, scale, ends)
        self.bits, self.group_size = bits, group_size

    def __call__(self, window: int | None) -> QuantizedAttend:
        """The :data:`QuantizedAttend` of a layer with sliding ``window`` (None: full attention)."""
        # mlx-lm's import pulls in transformers (and torch where installed): only here, for kv_bits
        from mlx_lm.models.base import quantized_scaled_dot_product_attention

        bits, group = self.bits, self.group_size

        def attend(q, k, v, keys: Quantized, values: Quantized) -> tuple[mx.array, Quantized, Quantized]:
            index = self.paged.index(keys[0].shape[1], keys[0].shape[2])
            keys = write_quantized(keys, index, k, bits, group)
            values = write_quantized(values, index, v, bits, group)
            view_k, view_v = gather_quantized(keys, index), gather_quantized(values, index)
            mask = self.paged.mask(window, view_k[0].shape[2])
            o = quantized_scaled_dot_product_attention(
                q, view_k, view_v, scale=self.paged.scale, mask=mask, group_size=group, bits=bits
            )
            return o, keys, values

        return attend


def paged_attention(
    block_table: mx.array,
    positions: mx.array,
    scale: float,
    bits: int | None = None,
    group_size: int = 64,
    ends: mx.array | None = None,
) -> PagedAttention | QuantizedPagedAttention:
    """The attention of a paged step over a pool: :class:`QuantizedPagedAttention` with
    ``bits`` (a ``kv_bits`` pool), else :class:`PagedAttention`; arguments as theirs."""
    if bits:
        return QuantizedPagedAttention(block_table, positions, scale, bits, group_size, ends)
    return PagedAttention(block_table, positions, scale, ends)
