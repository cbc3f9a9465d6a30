"""Each layer's cache layout, learnt from the model's own mlx-lm caches.

mlx-lm does not declare what its caches hold: a layer's key and value shapes follow from its
module (multi-head latent attention caches a latent and a RoPE key of different widths; a
recurrent layer caches a convolution window and an SSM state). So the layouts are read off
mlx-lm's own caches (``mlx_lm.models.cache.make_prompt_cache``) after one eager token: kind,
heads, head dims, dtype, a sliding layer's window (its ``RotatingKVCache``'s ``max_size``),
state shapes. The same eager call lets a module memoize weights it derives on its first call
(outside a trace, where it would keep placeholders).

A :class:`KVLayout` is one buffer pair of :class:`models.kv_cache.KVCache`; a
:class:`StateLayout` is ``len(shapes)`` of its ``states``; a :class:`ListLayout` (mlx-lm's
``CacheList``) is its parts in order; an :class:`UnusedLayout` (a cache the module never
writes) holds nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ConcatenateKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from models.errors import ModelLoadError


class UnsupportedCache(ModelLoadError):
    """A model's cache the adapter cannot hold (named with the reason)."""


@dataclass(frozen=True)
class KVLayout:
    """An attention layer's keys [B, heads, S, key_dim] and values [B, heads, S, value_dim];
    ``window``: its sliding window in positions, or None (full attention)."""

    heads: int
    key_dim: int
    value_dim: int
    window: int | None = None

    def row_bytes(self, size: int, itemsize: int) -> int:
        """Bytes of one row's keys and values at ``size`` positions of ``itemsize`` bytes."""
        return size * self.heads * (self.key_dim + self.value_dim) * itemsize


@dataclass(frozen=True)
class StateLayout:
    """A recurrent layer's state arrays, each [B, *shape] of its dtype (one per entry)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[mx.Dtype, ...]

    def row_bytes(self) -> int:
        """Bytes of one row's states."""
        return sum(math.prod(s) * d.size for s, d in zip(self.shapes, self.dtypes, strict=True))


@dataclass(frozen=True)
class ListLayout:
    """Several caches of one layer (mlx-lm's ``CacheList``), in order."""

    parts: tuple[Layout, ...]


@dataclass(frozen=True)
class UnusedLayout:
    """A cache entry the module gives a layer that never writes it (mlx-lm's nemotron-nas makes
    a ``KVCache`` for layers whose attention is replaced by a linear map): no buffers."""


Layout = KVLayout | StateLayout | ListLayout | UnusedLayout


def learn_layouts(model: nn.Module) -> tuple[Layout, ...]:
    """One :data:`Layout` per entry of ``make_prompt_cache(model)`` (per layer), read after the
    model ran one token eagerly through those caches.

    Raises:
        UnsupportedCache: a cache kind the adapter cannot hold (a chunked or quantized cache,
            a rotating cache that keeps a prefix, a state entry the token left unset).
    """
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([[1]], mx.int32), cache=caches))
    return tuple(layout_of(c) for c in caches)


def layout_of(cache) -> Layout:
    """The :data:`Layout` of one of mlx-lm's caches that has seen at least one token.

    Raises:
        UnsupportedCache: see :func:`learn_layouts`.
    """
    if isinstance(cache, CacheList):
        return ListLayout(tuple(layout_of(c) for c in cache.caches))
    if isinstance(cache, ArraysCache):
        arrays = [a for a in cache.cache if a is not None]
        if len(arrays) < len(cache.cache):
            raise UnsupportedCache(f"a state entry of {type(cache).__name__} stayed unset after a token")
        return StateLayout(tuple(tuple(a.shape[1:]) for a in arrays), tuple(a.dtype for a in arrays))
    window = None
    if type(cache) is RotatingKVCache:
        if cache.keep:
            raise UnsupportedCache(f"a RotatingKVCache that keeps its first {cache.keep} positions")
        window = cache.max_size
    elif type(cache) not in (KVCache, ConcatenateKVCache):
        raise UnsupportedCache(f"mlx-lm's {type(cache).__name__}")
    keys, values = cache.keys, cache.values
    if keys is None and values is None and window is None:
        return UnusedLayout()
    if keys is None or values is None:
        raise UnsupportedCache(f"{type(cache).__name__} held no keys after a token")
    return KVLayout(keys.shape[1], keys.shape[3], values.shape[3], window)


def flatten(layouts: tuple[Layout, ...]) -> tuple[list[KVLayout], list[StateLayout]]:
    """The KV layouts and state layouts of ``layouts`` in cache order (a list's parts in turn):
    KV layout i is buffer pair i of the cache, state layout j its next ``len(shapes)`` states."""
    kv: list[KVLayout] = []
    states: list[StateLayout] = []

    def walk(layout: Layout) -> None:
        if isinstance(layout, ListLayout):
            for part in layout.parts:
                walk(part)
        elif isinstance(layout, KVLayout):
            kv.append(layout)
        elif isinstance(layout, StateLayout):
            states.append(layout)

    for layout in layouts:
        walk(layout)
    return kv, states
