"""Unmodified mlx-lm model classes in stepserve's compiled, bucketed steps, through caches
that speak mlx-lm's cache protocol over fixed buffers (:mod:`models.adapter.cache`), laid out
per layer as the model's own caches are (:mod:`models.adapter.layout`), with the step
functions of the hand-written architectures (:mod:`models.adapter.steps`)."""

from models.adapter.cache import SlotKVCache, SlotStateCache
from models.adapter.layout import KVLayout, ListLayout, StateLayout, UnsupportedCache, learn_layouts
from models.adapter.steps import AdapterArgs, decode, prefill, prefill_chunk, verify

__all__ = [
    "AdapterArgs",
    "KVLayout",
    "ListLayout",
    "SlotKVCache",
    "SlotStateCache",
    "StateLayout",
    "UnsupportedCache",
    "decode",
    "learn_layouts",
    "prefill",
    "prefill_chunk",
    "verify",
]
