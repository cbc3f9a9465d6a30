"""Memory estimate at load time: weights plus the largest KV caches a model can allocate."""

from __future__ import annotations

from dataclasses import dataclass

from models.loader import LoadedModel
from service.engine.buckets import BucketTable


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one model may hold at its worst.

    Attributes:
        weights: the parameters.
        decode_cache: the KV cache at (batch bucket of max_running, largest capacity); counted
            twice in ``total``, since a bucket move holds the old and the new cache.
        prefill_cache: the KV cache of the largest prefill (batch of max_admit, largest prompt).
    """

    model: str
    weights: int
    decode_cache: int
    prefill_cache: int

    @property
    def total(self) -> int:
        return self.weights + 2 * self.decode_cache + self.prefill_cache

    def describe(self) -> str:
        gb = 1e9
        return (
            f"model '{self.model}': {self.total / gb:.2f} GB = weights {self.weights / gb:.2f} GB"
            f" + 2 x decode KV cache {self.decode_cache / gb:.2f} GB"
            f" + prefill KV cache {self.prefill_cache / gb:.2f} GB"
        )


def kv_bytes_per_position(model: LoadedModel) -> int:
    """Bytes one row's KV cache takes per position: keys and values of every layer,
    2 x layers x Hkv x D x the compute dtype's size."""
    a = model.args
    return 2 * a.num_hidden_layers * a.num_key_value_heads * a.dim_per_head * model.dtype.size


def estimate(model: LoadedModel, buckets: BucketTable, max_running: int, max_admit: int) -> MemoryEstimate:
    """Worst-case bytes of ``model`` served with ``buckets`` (see :func:`kv_bytes_per_position`)."""
    per_position = kv_bytes_per_position(model)
    decode = buckets.batch_for(max_running) * buckets.capacity[-1] * per_position
    prefill = buckets.batch_for(min(max_admit, max_running)) * buckets.prompt[-1] * per_position
    return MemoryEstimate(model.name, model.nbytes, decode, prefill)
