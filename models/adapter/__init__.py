"""Unmodified mlx-lm model classes in stepserve's compiled, bucketed steps, through caches
that speak mlx-lm's cache protocol over fixed buffers (:mod:`models.adapter.cache`), laid out
per layer as the model's own caches are (:mod:`models.adapter.layout`), with the step
functions of the hand-written architectures (:mod:`models.adapter.steps`); which
architectures it serves and why it refuses the others is :mod:`models.adapter.support`."""

from models.adapter.cache import SlotKVCache, SlotStateCache, UnusedCache
from models.adapter.layout import KVLayout, ListLayout, StateLayout, UnsupportedCache, UnusedLayout, learn_layouts
from models.adapter.steps import AdapterArgs, StageTraits, decode, prefill, prefill_chunk, verify
from models.adapter.support import REFUSED, SUPPORTED, check_module, check_supported

__all__ = [
    "REFUSED",
    "SUPPORTED",
    "AdapterArgs",
    "KVLayout",
    "ListLayout",
    "SlotKVCache",
    "SlotStateCache",
    "StageTraits",
    "StateLayout",
    "UnsupportedCache",
    "UnusedCache",
    "UnusedLayout",
    "check_module",
    "check_supported",
    "decode",
    "learn_layouts",
    "prefill",
    "prefill_chunk",
    "verify",
]
