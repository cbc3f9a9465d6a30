"""Unmodified mlx-lm model classes in stepserve's compiled, bucketed steps, through caches
that speak mlx-lm's cache protocol over fixed buffers (:mod:`models.adapter.cache`), laid out
per layer as the model's own caches are (:mod:`models.adapter.layout`), with the step
functions of the hand-written architectures (:mod:`models.adapter.steps`); which
architectures it serves and why it refuses the others is :mod:`models.adapter.support`.

Importing this package does not import mlx-lm (which pulls in transformers and, where it is
installed, torch: seconds of start-up and a heavier process): :class:`AdapterArgs` and
:class:`StageTraits` come from :mod:`models.adapter.args`, and the other names are loaded on
first use (PEP 562), i.e. only where an mlx-lm module is served.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from models.adapter.args import AdapterArgs, StageTraits

if TYPE_CHECKING:
    from models.adapter.cache import QuantizedSlotKVCache, SlotKVCache, SlotStateCache, UnusedCache
    from models.adapter.layout import (
        KVLayout,
        ListLayout,
        StateLayout,
        UnsupportedCache,
        UnusedLayout,
        learn_layouts,
    )
    from models.adapter.steps import (
        decode,
        decode_paged,
        prefill,
        prefill_chunk,
        quantized_attention_error,
        verify,
        verify_paged,
    )
    from models.adapter.support import REFUSED, SUPPORTED, check_module, check_supported

_LAZY = {
    "QuantizedSlotKVCache": "cache",
    "SlotKVCache": "cache",
    "SlotStateCache": "cache",
    "UnusedCache": "cache",
    "KVLayout": "layout",
    "ListLayout": "layout",
    "StateLayout": "layout",
    "UnsupportedCache": "layout",
    "UnusedLayout": "layout",
    "learn_layouts": "layout",
    "decode": "steps",
    "decode_paged": "steps",
    "prefill": "steps",
    "prefill_chunk": "steps",
    "quantized_attention_error": "steps",
    "verify": "steps",
    "verify_paged": "steps",
    "REFUSED": "support",
    "SUPPORTED": "support",
    "check_module": "support",
    "check_supported": "support",
}


def __getattr__(name: str) -> Any:
    """The mlx-lm-dependent names, imported on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"models.adapter.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'models.adapter' has no attribute {name!r}")


__all__ = [
    "REFUSED",
    "SUPPORTED",
    "AdapterArgs",
    "KVLayout",
    "ListLayout",
    "QuantizedSlotKVCache",
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
    "decode_paged",
    "learn_layouts",
    "prefill",
    "prefill_chunk",
    "quantized_attention_error",
    "verify",
    "verify_paged",
]
