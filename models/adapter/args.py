"""What the engine knows of an mlx-lm module served through :mod:`models.adapter`: its
:class:`AdapterArgs` (layouts, widths, traits) and a pipeline stage's :class:`StageTraits`.

This module imports nothing of mlx-lm (whose import pulls in transformers and, where
installed, torch): a server of hand-written models tells an adapter model's args apart with
``isinstance(args, AdapterArgs)`` without loading mlx-lm. What needs mlx-lm (learning the
layouts, the steps) is imported where an mlx-lm module is actually served.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from models.kv_cache import KVCache, layer_sizes

if TYPE_CHECKING:
    from models.adapter.layout import KVLayout, Layout, StateLayout


def _runs_gated_delta(module: ModuleType | None) -> bool:
    """Whether ``module`` calls mlx-lm's ``gated_delta_update`` (it imports the function)."""
    update = getattr(module, "gated_delta_update", None)
    return getattr(update, "__module__", None) == "mlx_lm.models.gated_delta"


def loops_prompts_off_metal(architecture: str) -> bool:
    """Whether mlx-lm's module ``architecture`` (a key of
    :data:`models.adapter.support.SUPPORTED`) builds layers that run the gated delta update,
    found without building a model: the module itself, or a module of ``mlx_lm.models`` whose
    classes it uses (``qwen3_5_moe`` takes ``qwen3_5``'s model), transitively. Such a model's
    :attr:`AdapterArgs.loops_prompts` is true except on a Metal GPU (what ``stepserve models``
    lists). Imports the module (and mlx-lm)."""
    seen: set[str] = set()
    todo = [f"mlx_lm.models.{architecture}"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        module = importlib.import_module(name)
        if _runs_gated_delta(module):
            return True
        for value in vars(module).values():
            owner = getattr(value, "__module__", None) if isinstance(value, type) else None
            if owner and owner.startswith("mlx_lm.models.") and owner not in seen:
                todo.append(owner)
    return False


def _flatten(layouts: tuple[Layout, ...]) -> tuple[list[KVLayout], list[StateLayout]]:
    from models.adapter.layout import flatten  # imports mlx-lm; only an adapter model has layouts

    return flatten(layouts)


@dataclass(frozen=True)
class StageTraits:
    """What rank 0's engine must know of every pipeline stage's layers, not only its own
    (a stage's layers may be all attention while another's keep recurrent states): whether
    prompt rows may be padded, whether some layer keeps a state, whether the prefix cache can
    keep blocks, whether :func:`verify` serves it. Joined over the stages by :meth:`join`."""

    pads_prompts: bool
    has_states: bool
    prefix_blocks: bool
    can_verify: bool

    def packed(self) -> int:
        """The four flags as bits 0..3 of an int (for the start-up exchange)."""
        flags = (self.pads_prompts, self.has_states, self.prefix_blocks, self.can_verify)
        return sum(int(f) << i for i, f in enumerate(flags))

    @classmethod
    def unpacked(cls, bits: int) -> StageTraits:
        """The inverse of :meth:`packed`."""
        return cls(*(bool(bits >> i & 1) for i in range(4)))

    @classmethod
    def join(cls, stages: list[StageTraits]) -> StageTraits:
        """The whole model's traits from its stages': padding, prefix blocks and verify only
        where every stage allows them; states where any stage keeps one."""
        return cls(
            all(s.pads_prompts for s in stages),
            any(s.has_states for s in stages),
            all(s.prefix_blocks for s in stages),
            all(s.can_verify for s in stages),
        )


@dataclass(frozen=True, eq=False)
class AdapterArgs:
    """What the steps and the engine need of an mlx-lm module (static under compilation).

    Attributes:
        module: the mlx-lm ``nn.Module`` (its ``__call__(tokens [B, L], cache=list)`` returns
            logits [B, L, V]).
        layouts: one :data:`models.adapter.layout.Layout` per entry of its prompt cache.
        model_type: the checkpoint's ``model_type``.
        vocab_size: V, the logits' width.
        max_position_embeddings: the model's context length, where its config gives one.
        pads_prompts: whether a prompt row may be right-padded (every recurrent layer masks
            by ``ArraysCache.lengths``); where False, prefill and chunk rows must be exactly
            as long as their bucket (mamba's layers ignore ``lengths``).
        grouped_mask: attention masks carry a query-group axis, [B, 1, 1, N, S] (the module
            groups query heads per key-value head in its scores: mlx-lm's gemma2).
        group: where ``module`` is one pipeline stage (mlx-lm's ``PipelineMixin``, its
            ``layouts`` its own layers' only), the whole group's :class:`StageTraits`, which
            :attr:`has_states`, :attr:`prefix_blocks` and :attr:`can_verify` then answer
            (``pads_prompts`` is set to the group's too: :meth:`joined`); None: one process.
    """

    module: nn.Module
    layouts: tuple[Layout, ...]
    model_type: str
    vocab_size: int
    max_position_embeddings: int | None = None
    pads_prompts: bool = True
    grouped_mask: bool = False
    group: StageTraits | None = None

    @classmethod
    def from_module(cls, module: nn.Module, model_type: str | None = None) -> AdapterArgs:
        """Check that the adapter serves ``module`` (:func:`models.adapter.support.check_module`),
        learn its layouts (:func:`models.adapter.layout.learn_layouts`, one eager token), then
        whether padded prompts keep its states exact and which mask shape its attention takes
        (:func:`_padding_probe`: eager prefills of one row and of a few rows, one padded).
        ``model_type`` defaults to the module's.

        Raises:
            models.errors.ModelLoadError: an architecture or configuration the adapter refuses
                (:mod:`models.adapter.support`).
            models.adapter.layout.UnsupportedCache: a cache the adapter cannot hold, or a
                module that fails on a batch of rows with either mask shape.
        """
        from models.adapter.layout import learn_layouts  # imports mlx-lm: only for its models
        from models.adapter.steps import _padding_probe
        from models.adapter.support import check_module

        check_module(module)
        model_args = getattr(module, "args", None)
        layouts = learn_layouts(module)
        args = cls(
            module,
            layouts,
            model_type or getattr(module, "model_type", None) or getattr(model_args, "model_type", "unknown"),
            0,
            getattr(model_args, "max_position_embeddings", None),
        )
        return _padding_probe(args)

    @property
    def num_hidden_layers(self) -> int:
        """Layers (entries of the prompt cache)."""
        return len(self.layouts)

    @property
    def kv_layouts(self) -> list[KVLayout]:
        """The attention caches' layouts, one per buffer pair of a :class:`KVCache`."""
        return _flatten(self.layouts)[0]

    @property
    def state_layouts(self) -> list[StateLayout]:
        """The recurrent caches' layouts, in the order of a :class:`KVCache`'s states."""
        return _flatten(self.layouts)[1]

    @property
    def has_states(self) -> bool:
        """Whether some layer keeps a recurrent state (of any stage: :attr:`group`)."""
        return self.group.has_states if self.group is not None else bool(self.state_layouts)

    @property
    def loops_prompts(self) -> bool:
        """Whether a layer of the module runs mlx-lm's gated delta update
        (``mlx_lm.models.gated_delta.gated_delta_update``: qwen3_next, qwen3_5, kimi_linear, ...)
        as its ops loop, one position of the prompt at a time. mlx-lm takes that loop wherever
        it has no kernel for the update: unless the default device is a GPU and Metal is
        available (its own test, ``mx.metal.is_available()``). Traced, the loop becomes T
        unrolled steps per layer, which ran slower than the same loop eager on a CUDA GPU and
        as fast on the CPU (docs/BENCHMARKS.md, "Against peers on a GPU", Qwen3-Next); the
        executor then runs this model's prefill and chunk steps eagerly
        (:attr:`service.engine.compile_cache.StepSpec.eager`), its decode step compiled."""
        if mx.default_device().type == mx.DeviceType.gpu and mx.metal.is_available():
            return False
        return any(_runs_gated_delta(sys.modules.get(type(m).__module__)) for _, m in self.module.named_modules())

    @property
    def capacity_pair(self) -> bool:
        """Whether a :class:`KVCache` of this model ends with an empty pair of keys and values
        [B, 0, C, 0] that no layer reads (:meth:`allocate`): where no attention cache holds
        the full capacity (no attention layer, as mamba's, or only sliding ones, as
        recurrent_gemma's), it carries the capacity C that the engine reads of every cache
        (:attr:`models.kv_cache.KVCache.capacity`, the bucket of its compiled steps)."""
        return all(kv.window is not None for kv in self.kv_layouts)

    @property
    def windows(self) -> tuple[int | None, ...] | None:
        """The sliding window of each buffer pair of a :class:`KVCache` (one per layer for a
        plain attention model; None for the :attr:`capacity_pair`), or None when none slides:
        what :meth:`KVCache.resized` takes."""
        windows = tuple(kv.window for kv in self.kv_layouts) + ((None,) if self.capacity_pair else ())
        return windows if any(w is not None for w in windows) else None

    @property
    def can_verify(self) -> bool:
        """Whether :func:`verify` serves this model on the static cache: no sliding layer (its
        decode ring would be written past its size) and no recurrent state (a rejected proposal
        cannot be undone by position); in a group, on every stage. On the paged pool,
        :func:`models.adapter.verify_paged` serves sliding layers too
        (:func:`service.engine.executor.pool_verifies` decides)."""
        if self.group is not None:
            return self.group.can_verify
        return self.windows is None and not self.has_states

    @property
    def prefix_blocks(self) -> bool:
        """Whether the prefix cache can keep this model's prompt blocks: no recurrent state (a
        state cannot be cut at a block boundary) and every attention cache of one shape, keys
        as wide as values (:func:`service.engine.kv_blocks.copy_blocks` stacks them); in a
        group, on every stage (each rank stacks its own layers' blocks)."""
        if self.group is not None:
            return self.group.prefix_blocks
        shapes = {(k.heads, k.key_dim, k.value_dim) for k in self.kv_layouts}
        return not self.has_states and len(shapes) == 1 and all(k == v for _, k, v in shapes)

    def traits(self) -> StageTraits:
        """This module's own :class:`StageTraits` (its layers only, whatever :attr:`group` says)."""
        alone = dataclasses.replace(self, group=None)
        return StageTraits(self.pads_prompts, alone.has_states, alone.prefix_blocks, alone.can_verify)

    def joined(self, stages: list[StageTraits]) -> AdapterArgs:
        """These args as one stage of a group whose stages have ``stages``' traits
        (:meth:`StageTraits.join`): :attr:`group` set, ``pads_prompts`` the group's."""
        whole = StageTraits.join(stages)
        return dataclasses.replace(self, pads_prompts=whole.pads_prompts, group=whole)

    # What the engine's sizing reads of a model (:mod:`service.process.warm_sizing`,
    # :mod:`service.process.memory`), from the module's config where it names them.

    def _config(self, names: tuple[str, ...], default: int) -> int:
        """The first of ``names`` the module's ``args`` holds as an int, else ``default``."""
        model_args = getattr(self.module, "args", None)
        text = getattr(model_args, "text_config", None)  # a multimodal wrapper's text model
        for source in (model_args, text if isinstance(text, dict) else None):
            for name in names:
                value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    return value
        return default

    @property
    def num_key_value_heads(self) -> int:
        """Hkv: the most key-value heads of any attention cache (0: none)."""
        return max((k.heads for k in self.kv_layouts), default=0)

    @property
    def dim_per_head(self) -> int:
        """D: the widest key head of any attention cache (0: none)."""
        return max((k.key_dim for k in self.kv_layouts), default=0)

    @property
    def hidden_size(self) -> int:
        """The residual stream's width (the config's ``hidden_size`` or its synonyms)."""
        return self._config(("hidden_size", "d_model", "n_embd", "dim"), self.num_key_value_heads * self.dim_per_head)

    @property
    def num_attention_heads(self) -> int:
        """Query heads (the config's, else :attr:`num_key_value_heads`)."""
        return self._config(("num_attention_heads", "n_head", "num_heads", "n_heads"), self.num_key_value_heads)

    @property
    def intermediate_size(self) -> int:
        """The MLP's inner width (the config's, else 4 x :attr:`hidden_size`, GPT-2's ratio)."""
        return self._config(("intermediate_size", "ffn_dim", "n_inner", "d_ff"), 4 * self.hidden_size)

    @property
    def num_experts_per_tok(self) -> int:
        """Experts each token is routed to (0: a dense MLP)."""
        return self._config(("num_experts_per_tok", "moe_topk", "top_k"), 0)

    @property
    def moe_intermediate_size(self) -> int:
        """An expert's inner width (0: none given)."""
        return self._config(("moe_intermediate_size", "expert_intermediate_size"), 0)

    def kv_bytes(self, capacity: int, itemsize: int, ring: bool = True, layers: range | None = None) -> int:
        """Bytes of one row's cache at ``capacity`` positions: keys and values of ``itemsize``
        bytes per element (sliding layers holding min(W, C) positions when ``ring``: a decode
        cache) and the recurrent states in their own dtypes; only ``layers`` (a pipeline
        stage's) where given."""
        chosen = self.layouts if layers is None else self.layouts[layers.start : layers.stop]
        kv, states = _flatten(chosen)
        windows = [k.window for k in kv] if ring else None
        sizes = layer_sizes(len(kv), capacity, windows)
        return sum(k.row_bytes(s, itemsize) for k, s in zip(kv, sizes, strict=True)) + sum(
            s.row_bytes() for s in states
        )

    def allocate(self, batch: int, capacity: int, dtype: mx.Dtype, ring: bool = False) -> KVCache:
        """A zeroed cache of ``batch`` rows: keys and values [batch, Hkv, S, D] in ``dtype``, S
        = ``capacity`` (sliding layers min(W, C) when ``ring``: a decode cache), then the
        :attr:`capacity_pair` where there is one, and each recurrent state [batch, ...] in its
        own dtype."""
        widths = [(k.heads, k.key_dim, k.value_dim) for k in self.kv_layouts]
        widths += [(0, 0, 0)] if self.capacity_pair else []
        sizes = layer_sizes(len(widths), capacity, self.windows if ring else None)
        return KVCache(
            [mx.zeros((batch, h, s, dk), dtype) for (h, dk, _), s in zip(widths, sizes, strict=True)],
            [mx.zeros((batch, h, s, dv), dtype) for (h, _, dv), s in zip(widths, sizes, strict=True)],
            [
                mx.zeros((batch, *shape), d)
                for st in self.state_layouts
                for shape, d in zip(st.shapes, st.dtypes, strict=True)
            ],
        )
