"""A static, preallocated KV cache: one keys and one values buffer per layer.

Every buffer has the shape [B, Hkv, C, D]: B rows (a batch bucket), Hkv key-value heads,
C positions (a capacity bucket) and D the head dim. Step functions write into it at array
indices and return a new cache (MLX arrays are immutable values inside a compiled graph);
the capacity never changes inside a step, so each (B, C) pair is one compiled shape.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx


class KVCache(NamedTuple):
    """Per-layer key and value buffers, each [B, Hkv, C, D] (a pytree MLX compilation accepts)."""

    keys: list[mx.array]
    values: list[mx.array]

    @property
    def capacity(self) -> int:
        """C: positions per row."""
        return self.keys[0].shape[2]

    @property
    def batch(self) -> int:
        """B: rows (slots)."""
        return self.keys[0].shape[0]

    @property
    def dtype(self) -> mx.Dtype:
        return self.keys[0].dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    @staticmethod
    def allocate(layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: mx.Dtype) -> KVCache:
        """Zero-filled cache of ``layers`` x [batch, kv_heads, capacity, head_dim]."""
        shape = (batch, kv_heads, capacity, head_dim)
        return KVCache(
            [mx.zeros(shape, dtype) for _ in range(layers)],
            [mx.zeros(shape, dtype) for _ in range(layers)],
        )

    def resized(self, capacity: int) -> KVCache:
        """A copy at another capacity: zero-padded when growing, truncated when shrinking.

        Truncation drops positions >= ``capacity``; callers shrink only below every live
        row's length. This is the one copy a bucket move costs.
        """
        C = self.capacity
        if capacity == C:
            return self
        if capacity < C:
            return KVCache([k[:, :, :capacity] for k in self.keys], [v[:, :, :capacity] for v in self.values])
        pad = [(0, 0), (0, 0), (0, capacity - C), (0, 0)]
        return KVCache([mx.pad(k, pad) for k in self.keys], [mx.pad(v, pad) for v in self.values])
