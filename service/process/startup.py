"""Start-up: resolve each model's dtype and weight format, load the models, and check their
worst-case memory against the budget before anything is served."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Literal

import mlx.core as mx

from models.adapter import AdapterArgs
from models.blas import OPENBLAS_FIX, cpu_blas
from models.default import default_model_path
from models.errors import ModelLoadError
from models.hub import resolve_model_path
from models.loader import LoadedModel, WeightsMode, device_name, load_model
from models.sentence import EmbeddingModel, load_embedding_model
from service.config import ServedModel, Settings
from service.engine.buckets import BucketTable, unpadded_prompt_ladder
from service.engine.embedder import length_buckets
from service.engine.executor import adapter_kv_bits_error, pages, pool_verifies, prefills_in_blocks
from service.engine.warmup import WarmupSpec
from service.process import memory, warm_sizing
from service.process.warm_sizing import Coverage

log = logging.getLogger("stepserve")


class MemoryBudgetError(RuntimeError):
    """The configured models may need more memory than ``memory_budget_bytes``."""


_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def compute_dtype(setting: str) -> mx.Dtype:
    """The compute dtype: ``auto`` is float16 on a GPU and float32 on the CPU, where float16
    matmuls are far slower (docs/BENCHMARKS.md, "Weights and dtype on the CPU")."""
    if setting == "auto":
        return mx.float16 if device_name() == "gpu" else mx.float32
    return _DTYPES[setting]


def weights_mode(setting: Literal["auto", "quantized", "dequantized"]) -> WeightsMode:
    """``auto`` keeps weights quantized on a GPU (memory is what limits a Mac mini) and
    dequantizes them on the CPU, where dense float32 matmuls are faster than MLX's quantized
    kernels (docs/BENCHMARKS.md, "Weights and dtype on the CPU")."""
    if setting == "auto":
        return "quantized" if device_name() == "gpu" else "dequantized"
    return setting


def load_models(settings: Settings) -> dict[str, LoadedModel]:
    """Load every model with ``load = "startup"`` (:func:`load_served`), in order, and resolve
    the path of every ``load = "on_demand"`` one (so that a repo id missing offline fails at
    start-up, and one online is downloaded now, not on its first request).

    Raises:
        ModelLoadError: as :func:`load_served`, or an on-demand model's repo id cannot be
            resolved (:func:`models.hub.resolve_model_path`).
    """
    log_cpu_blas()
    models: dict[str, LoadedModel] = {}
    for spec in settings.chat_models():
        if spec.load == "on_demand":
            for path in (spec.path, spec.draft_model):
                if path is not None:
                    resolve_model_path(path)
            log.info("model %s: loaded on demand (%s)", spec.name, spec.path or "the default model")
            continue
        models |= load_served(spec, paged=None if settings.kv_cache == "auto" else settings.kv_cache == "paged")
    return models


def model_path(path: Path | None) -> Path:
    """The file or directory of a model setting: the default GGUF where unset, a Hugging Face
    repo id's snapshot directory (:func:`models.hub.resolve_model_path`), else ``path``.

    Raises:
        ModelLoadError: the default model is not installed, or the repo id cannot be resolved.
    """
    return default_model_path() if path is None else resolve_model_path(path)


def load_served(spec: ServedModel, paged: bool | None = False) -> dict[str, LoadedModel]:
    """Load one served model (and its draft model, with ``speculative = "draft"``, as
    ``"NAME/draft"``, :func:`draft_name`), each as its ``model_impl`` says
    (:func:`models.loader.load_model`; a draft model as ``auto`` does); its path through
    :func:`model_path`. ``paged``: decode runs on a paged KV pool (``kv_cache = "paged"``), whose
    verify step (:func:`service.engine.executor.pool_verifies`: a hand-written family's, or
    mlx-lm's class wherever the pool holds it) takes a model with sliding-window layers too (its
    view of a row is linear); None: not known yet (``kv_cache = "auto"``, resolved once the
    models are loaded, :func:`resolve_kv_cache`), checked as for the static cache.

    Raises:
        ModelLoadError: a file is missing, unreadable or unsupported (the message names it),
            a repo id cannot be resolved, ``paged`` and the pool cannot hold the model's caches
            (:func:`paged_error`), a draft's vocabulary differs from its model's, a draft
            keeps a recurrent state, or a model with recurrent state, with sliding-window
            layers on the static cache, or without a paged verify step on the pool is given a
            draft (with ``speculative = "lookup"`` it decodes plain, logged).
    """
    dtype, weights = compute_dtype(spec.dtype), weights_mode(spec.weights)
    model = load_model(model_path(spec.path), spec.name, dtype, weights, impl=spec.model_impl)
    if (error := paged_error("paged" if paged else "static", model)) is not None:
        raise ModelLoadError(f"model '{spec.name}': {error}")
    models = {spec.name: model}
    where = model.path if spec.path is None or Path(spec.path) == model.path else f"{spec.path} ({model.path})"
    log.info("model %s: %s served by %s (loaded in %.1f s)", spec.name, where, _served_by(model), model.load_seconds)
    if device_name() == "cpu" and None in (spec.warmup_prompt_tokens, spec.warmup_batch):
        args = model.args  # the host's matmul rate (warmup_extent), before any engine runs
        warm_sizing.measure_gflops(args.hidden_size, args.intermediate_size, dtype)
    verifies = pool_verifies(model) if paged else model.args.can_verify
    if spec.speculative == "lookup" and not verifies:
        if paged and not model.args.has_states:
            log.info("model '%s': %s decodes without speculation on the paged pool", spec.name, _served_by(model))
        else:
            unless = ""
            if not paged and pool_verifies(model):
                unless = (
                    " on the static cache (kv_cache = 'auto': the paged pool, where it speculates, if chosen below)"
                    if paged is None
                    else " unless kv_cache = 'paged'"
                )
            log.info("model '%s' has %s: it decodes without speculation%s", spec.name, _no_verify(model), unless)
    if spec.speculative == "draft" and not verifies:
        if model.args.has_states:
            raise ModelLoadError(
                f"model '{spec.name}': speculative = 'draft' is not implemented for models with recurrent state "
                "(a verify step cannot take back a state, on the static cache or the paged pool); set "
                "speculative = 'off' for it"
            )
        if paged:
            raise ModelLoadError(
                f"model '{spec.name}': speculative = 'draft' on the paged pool needs a paged verify step, which "
                f"{_served_by(model)} has not; set speculative = 'off', or kv_cache = 'static'"
            )
        fix = "set speculative = 'off' for it"
        if pool_verifies(model):
            fix = "set kv_cache = 'paged', or speculative = 'off'"
        raise ModelLoadError(
            f"model '{spec.name}': speculative = 'draft' is not implemented for models with sliding-window layers "
            f"on the static cache (a verify step cannot write a ring); {fix}"
        )
    if spec.speculative == "draft" and spec.draft_model is not None:
        draft = load_model(model_path(spec.draft_model), draft_name(spec.name), dtype, weights)
        if draft.args.has_states:
            raise ModelLoadError(
                f"draft_model {spec.draft_model}: its model_type '{draft.args.model_type}' keeps a recurrent "
                "state, which a draft cannot take back when its proposals are rejected; choose another draft"
            )
        if draft.args.vocab_size != model.args.vocab_size:
            raise ModelLoadError(
                f"draft_model {spec.draft_model}: a vocabulary of {draft.args.vocab_size} tokens, but model "
                f"'{spec.name}' has {model.args.vocab_size}; a draft must share its model's tokenizer"
            )
        models[draft.name] = draft
    return models


def load_embedders(settings: Settings) -> dict[str, EmbeddingModel]:
    """Load every served embedding model (:meth:`Settings.embedding_models`), in order, in its
    compute dtype (:func:`compute_dtype`).

    Raises:
        ModelLoadError: a file is missing or unreadable, or the encoder is not implemented.
    """
    models = {}
    for spec in settings.embedding_models():
        assert spec.path is not None  # an embedding model is found by its path
        model = load_embedding_model(spec.path, spec.name, compute_dtype(spec.dtype))
        log.info("embedding model %s: %s (loaded in %.1f s)", spec.name, model.path, model.load_seconds)
        models[spec.name] = model
    return models


def _served_by(model: LoadedModel) -> str:
    """Which implementation runs ``model``: mlx-lm's class (through the cache adapter) or a
    hand-written module, as a noun phrase naming it."""
    if isinstance(model.args, AdapterArgs):
        return f"mlx-lm's class {type(model.args.module).__module__}.{type(model.args.module).__name__}"
    return f"the hand-written module for {model.args.model_type}"


def _no_verify(model: LoadedModel) -> str:
    """Why ``model`` has no verify step, as a noun phrase."""
    return "recurrent state" if model.args.has_states else "sliding-window layers"


def paged_error(kv_cache: str, model: LoadedModel) -> str | None:
    """Why a paged KV pool (``kv_cache = 'paged'``) cannot hold ``model``'s caches (or a
    pipeline stage's, its own layers': :func:`service.engine.executor.pages`), naming its
    model_type, the reason and the fix; None where it can or ``kv_cache`` is not ``'paged'``.
    The pool holds mlx-lm's classes whose attention caches are all of one shape, keys as wide
    as values, with no recurrent state and a full-attention layer; not, e.g., DeepSeek-V3's
    latent attention (keys wider than values) or Qwen3-Next's recurrent layers."""
    if kv_cache != "paged" or pages(model):
        return None
    args = model.args
    if not isinstance(args, AdapterArgs):
        why = "its hand-written module has no paged decode step"
    elif args.has_states:
        why = "some layer keeps a recurrent state"
    elif args.capacity_pair:
        why = "no attention layer holds the whole sequence (none, or only sliding windows)"
    else:
        shapes = sorted({(k.heads, k.key_dim, k.value_dim) for k in args.kv_layouts})
        why = (
            f"its attention caches are of {len(shapes)} shapes"
            if len(shapes) > 1
            else f"its keys are {shapes[0][1]} wide and its values {shapes[0][2]}; a block holds both at one width"
        )
    return (
        f"kv_cache = 'paged' cannot hold the caches of model_type '{args.model_type}' ({why}); "
        "set kv_cache = 'static' (--kv-cache static)"
    )


def draft_name(model: str) -> str:
    """The name a model's draft model is loaded (and its compiled steps labelled) under."""
    return f"{model}/draft"


def buckets_of(spec: ServedModel, model: LoadedModel, capacity: list[int] | None = None) -> BucketTable:
    """The bucket table of one served model's settings, for ``model``: a model whose prompt
    rows cannot be padded gets the prompt buckets below the smallest too
    (:func:`service.engine.buckets.unpadded_prompt_ladder`). ``capacity``: a capacity ladder
    instead of the settings' (a paged pool's, being sized)."""
    prompt = tuple(spec.prompt_buckets)
    if not model.args.pads_prompts:
        prompt = unpadded_prompt_ladder(prompt)
    return BucketTable(tuple(spec.batch_buckets), prompt, tuple(capacity or spec.capacity_buckets))


def resolve_kv_cache(settings: Settings, models: dict[str, LoadedModel], device: str, group: bool = False) -> Settings:
    """``settings`` with ``kv_cache = 'auto'`` resolved, for one process (or, ``group``, a
    pipeline group's rank) on ``device`` (:func:`models.loader.device_name`) serving the chat
    ``models`` loaded at start-up; other values are returned as they are.

    'auto' is the paged pool (:mod:`service.engine.kv_blocks`) on a GPU, where the KV cache is
    what bounds how many sequences fit (a Mac's unified memory; a CUDA GPU's, where the pool's
    decode attention is one kernel, :mod:`models.paged_kernel`), when every such model's caches
    page (:func:`service.engine.executor.pages`), no chat model loads on demand (its caches are
    unknown until then) and none has a draft model (a draft's steps run on the static cache).
    Otherwise static: on the CPU, where no kernel reads the pool (a paged step gathers each
    row's blocks into a view per layer, :class:`models.paged.PagedAttention`, and the static
    cache serves as fast or faster there: docs/BENCHMARKS.md), in a pipeline group (which pages
    only where ``kv_cache = 'paged'`` asks), or naming the model that cannot page. The choice
    and its reason are logged.
    """
    if settings.kv_cache != "auto":
        return settings
    specs = settings.chat_models()
    reasons = [
        f"model '{s.name}' loads on demand" if s.load == "on_demand" else f"model '{s.name}' has a draft model"
        for s in specs
        if s.load == "on_demand" or s.speculative == "draft"
    ]
    reasons += [
        f"model '{s.name}' ({models[s.name].args.model_type}) cannot page"
        for s in specs
        if s.name in models and not pages(models[s.name])
    ]
    if group:
        reasons.insert(0, "a pipeline group, which pages only with kv_cache = 'paged'")
    if device != "gpu":
        reasons.insert(0, "on the CPU")
    kv_cache = "static" if reasons else "paged"
    log.info(
        "kv_cache = 'auto': %s (%s)",
        kv_cache,
        "; ".join(reasons) if reasons else "a GPU, and every model pages",
    )
    return settings.model_copy(update={"kv_cache": kv_cache})


def check_memory(
    settings: Settings, models: dict[str, LoadedModel], embedders: dict[str, EmbeddingModel] | None = None
) -> Settings:
    """Check the worst case of every model in ``models`` (:func:`service.process.memory.worst_case`,
    a draft model's included; an on-demand model counts once it is loaded) and of every embedding
    model in ``embedders`` (:func:`service.process.memory.embedding_worst_case`: its weights and
    its largest step) against the budget and resolve ``max_sequences`` where it is unset.

    The budget is ``memory_budget_bytes``, else ``mlx_memory_limit_bytes``, else MLX's own
    memory limit (``mx.get_memory_limit()``). A model without ``max_sequences`` gets the
    largest running batch (one of its batch buckets) with which all the models fit; the
    embedding models' bytes are taken off the budget first. Each model's figures are logged.

    ``kv_cache = 'auto'`` is resolved first (:func:`resolve_kv_cache`).

    Returns:
        ``settings`` with ``kv_cache`` resolved and the ``max_sequences`` of every model in
        ``models`` set.

    Raises:
        MemoryBudgetError: the models cannot fit the budget (even at one sequence each where
            ``max_sequences`` is unset); the message names each model's figures and the fix.
    """
    settings = resolve_kv_cache(settings, models, device_name())
    specs = [s for s in settings.chat_models() if s.name in models]  # on-demand ones once loaded
    name, budget = _budget(settings)
    limit = budget if budget is not None else mx.get_memory_limit()
    embedding = embedding_estimates(settings, embedders or {})
    for e in embedding:
        log.info("embedding model %s: worst case %s", e.model, e.describe())
    if not specs:  # embedding models only: no KV cache to size
        total = sum(e.total for e in embedding)
        if total > limit and budget is not None:
            raise MemoryBudgetError(
                f"the models need up to {total / 1e9:.2f} GB, over {name} {limit / 1e9:.2f} GB "
                f"({'; '.join(e.describe() for e in embedding)}); {_fix(embedding, chat=False)}"
            )
        if total > limit:
            log.warning("the embedding models could need %.2f GB, over %s %.2f GB", total / 1e9, name, limit / 1e9)
        return settings
    if settings.kv_cache == "paged":
        return _check_paged(settings, models, specs, name, limit, embedding, capped=budget is None)
    candidates = sorted({b for s in specs if s.max_sequences is None for b in s.batch_buckets}, reverse=True) or [0]
    for rows in candidates:
        resolved = {s.name: s.max_sequences or min(rows, s.batch_buckets[-1]) for s in specs}
        estimates = [
            memory.worst_case(
                models[s.name],
                buckets_of(s, models[s.name]),
                resolved[s.name],
                settings.prefill_chunk_tokens,
                settings.max_batched_tokens,
                settings.prefix_cache_bytes if models[s.name].args.prefix_blocks else 0,  # build.prefix_budget
            )
            for s in specs
        ]
        drafts = [  # a draft's weights, its cache mirroring the model's, and its catch-up prefill
            memory.worst_case(
                models[draft_name(s.name)],
                buckets_of(s, models[s.name]),
                resolved[s.name],
                settings.prefill_chunk_tokens,
                settings.max_batched_tokens,
            )
            for s in specs
            if draft_name(s.name) in models
        ]
        everything = estimates + drafts
        total = sum(e.total for e in everything) + sum(e.total for e in embedding)
        if total <= limit:
            break
    lines = "; ".join(e.describe() for e in (*everything, *embedding))
    for spec, e in zip(specs, estimates, strict=True):
        how = "set" if spec.max_sequences else f"the most whose worst case fits {name} {limit / 1e9:.2f} GB"
        log.info("model %s: max_sequences %d (%s); worst case %s", spec.name, resolved[spec.name], how, e.describe())
    if total > limit and (budget is not None or any(s.max_sequences is None for s in specs)):
        raise MemoryBudgetError(
            f"the models need up to {total / 1e9:.2f} GB, over {name} {limit / 1e9:.2f} GB ({lines}); "
            f"{_fix(embedding, chat=True)}"
        )
    if total > limit:
        log.warning("the configured max_sequences could need %.2f GB, over %s %.2f GB", total / 1e9, name, limit / 1e9)
    return _with_max_sequences(settings, resolved)


def embedding_estimates(settings: Settings, embedders: dict[str, EmbeddingModel]) -> list[memory.EmbeddingEstimate]:
    """The worst case of each embedding model in ``embedders`` (in the settings' order) at the
    buckets its engine gets (:func:`service.process.build.build_embedder`): its ``batch_buckets``
    and the length buckets of its ``prompt_buckets`` up to its longest input."""
    return [
        memory.embedding_worst_case(
            embedders[s.name], s.batch_buckets, length_buckets(s.prompt_buckets, embedders[s.name].max_tokens)
        )
        for s in settings.embedding_models()
        if s.name in embedders
    ]


def _fix(embedding: list[memory.EmbeddingEstimate], chat: bool) -> str:
    """The fixes for a configuration over the budget, as its refusal ends."""
    first = "lower max_sequences or the largest capacity bucket" if chat else "raise the budget"
    return f"{first}{_embedding_fix(embedding)}, or serve fewer models"


def context_ladder(buckets: list[int], limit: int, block_tokens: int) -> list[int]:
    """``buckets`` (ascending capacity buckets) extended by doubling up to ``limit`` positions,
    the last one ``limit`` itself rounded down to whole blocks of ``block_tokens``; buckets above
    ``limit`` are dropped. E.g. [256, …, 8192] to 45,330 in blocks of 16: …, 8192, 16384, 32768,
    45328."""
    top = limit // block_tokens * block_tokens
    ladder = [b for b in buckets if b <= top]
    while not ladder or ladder[-1] < top:
        ladder.append(min(top, 2 * ladder[-1]) if ladder else top)
    return ladder


def _check_paged(
    settings: Settings,
    models: dict[str, LoadedModel],
    specs: list[ServedModel],
    name: str,
    limit: int,
    embedding: list[memory.EmbeddingEstimate],
    capped: bool,
) -> Settings:
    """:func:`check_memory` with paged KV pools: each model holds its weights, its largest
    prefill step, its prefix cache and a pool, not a worst-case batch. ``max_sequences``, unset,
    is the largest batch bucket (a cap on running rows; the pool's blocks decide how many fit).
    A model's ``kv_pool_tokens`` (its ``[[models]]`` entry's, else the top level's) is its pool's
    size as given; the models without one split what the budget leaves after the embedding
    models (``embedding``) and the given pools evenly in bytes, each share in tokens at its
    model's bytes per position (its ``kv_bits``: a quantized pool holds more tokens). With no
    budget set (``capped``: neither ``memory_budget_bytes`` nor ``mlx_memory_limit_bytes``, so
    ``limit`` is MLX's own, most of the device) a share is at most ``max_sequences`` sequences at the ladder's top:
    more blocks could only cache prefixes, and the rest is left to the host. Pools over the
    budget are logged as a warning.

    A sequence may grow to the model's context (``max_model_len``, else its
    ``max_position_embeddings``) where the pool holds that much: unless the capacity buckets
    are set, the ladder is extended by doubling up to that limit (:func:`context_ladder`). A longer
    ladder needs a larger prefill step, which leaves less for the pool, so where the pool would
    not hold one sequence at the context, the ladder's top is the longest (in whole blocks) whose
    pool, beside that step, still does; the log gives the top.

    Raises:
        MemoryBudgetError: a pool would hold less than the smallest capacity bucket; the message
            names the figures and the fix.
        ModelLoadError: a model's ``kv_bits`` cannot quantize its heads (:func:`check_kv_heads`).
    """
    for s in specs:
        check_kv_heads(settings, s, models[s.name])
    resolved = {s.name: s.max_sequences or s.batch_buckets[-1] for s in specs}
    bt, gb = settings.kv_block_tokens, 1e9
    chosen = "capacity_buckets" in settings.model_fields_set
    extended = {}  # name: the context its ladder was extended to
    for s in specs:
        context = settings.max_model_len or getattr(models[s.name].args, "max_position_embeddings", None)
        if context and not chosen and not _per_model(settings, s.name, "capacity_buckets"):
            extended[s.name] = context
    embedded = sum(e.total for e in embedding)
    per_position = {s.name: memory.pool_bytes_per_position(models[s.name], s.kv_bits) for s in specs}
    given = {s.name: s.kv_pool_tokens for s in specs if s.kv_pool_tokens is not None}  # set: taken as given
    unset = [s for s in specs if s.name not in given]

    def sized(
        tops: dict[str, int],
    ) -> tuple[dict[str, list[int]], dict[str, memory.MemoryEstimate], int, dict[str, int]]:
        """(ladders, each model's weights and largest prefill step, the bytes left for pools, pools)
        with the extended ladders topped at ``tops``."""
        ladders = {s.name: list(s.capacity_buckets) for s in specs}
        ladders |= {n: context_ladder(ladders[n], top, bt) for n, top in tops.items()}
        fixed = {  # no prefix cache of its own: the pool's cached blocks are the prefix cache
            s.name: memory.worst_case(
                models[s.name],
                buckets_of(s, models[s.name], ladders[s.name]),
                resolved[s.name],
                settings.prefill_chunk_tokens,
                settings.max_batched_tokens,
                in_blocks=prefills_in_blocks(models[s.name], s.kv_bits),  # no staging cache beside the pool
            )
            for s in specs
        }
        rest = limit - sum(e.weights + e.prefill + e.prefix_cache for e in fixed.values()) - embedded
        left = rest - sum(given[n] * per_position[n] for n in given)  # the unset ones split the rest evenly in bytes
        share = {s.name: max(0, left // len(unset) // per_position[s.name]) for s in unset}
        if capped:  # more than every row at the ladder's top would only hold cached prefixes
            share = {n: min(t, resolved[n] * -(-ladders[n][-1] // bt) * bt) for n, t in share.items()}
        pools = given | share
        return ladders, fixed, rest, pools

    # A longer ladder needs a larger prefill step, which leaves a smaller pool: each extended
    # ladder's top is the longest sequence (in whole blocks, up to its context) whose pool, with
    # that step, still holds it; the smallest bucket where none does (refused below).
    tops = dict(extended)
    for s in specs:
        n = s.name
        if n not in extended or sized(tops)[3][n] >= tops[n]:
            continue
        lo, hi = 0, extended[n] // bt  # in blocks: lo fits (or is the floor), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if sized(tops | {n: mid * bt})[3][n] >= mid * bt:
                lo = mid
            else:
                hi = mid
        tops[n] = max(lo * bt, s.capacity_buckets[0])
    ladders, fixed, rest, pools = sized(tops)
    if settings.prefix_cache_bytes and "prefix_cache_bytes" in settings.model_fields_set:
        log.warning(
            "prefix_cache_bytes = %d does not apply with kv_cache = 'paged': prefixes are cached in the pool's "
            "blocks no request holds (evicted least recently used first as requests need blocks); "
            "prefix_cache_bytes = 0 turns prefix caching off",
            settings.prefix_cache_bytes,
        )
    beside = f" beside the embedding models' {embedded / 1e9:.2f} GB" if embedding else ""
    held = sum(pools[n] * per_position[n] for n in pools)
    if held > rest:
        log.warning(
            "the paged KV pools (%s) take %.2f GB, over the %.2f GB %s %.2f GB leaves after the weights and "
            "prefill steps%s",
            ", ".join(f"{n} {t} tokens" for n, t in pools.items()), held / gb, max(0, rest) / gb, name,
            limit / gb, beside,
        )  # fmt: skip
    for s in specs:
        per, pool = per_position[s.name], pools[s.name]
        if pool < ladders[s.name][0]:
            raise MemoryBudgetError(
                f"model '{s.name}': its paged KV pool would hold {pool} tokens, fewer than the smallest capacity "
                f"bucket ({ladders[s.name][0]}), within {name} {limit / gb:.2f} GB{beside}; raise the budget"
                f"{_embedding_fix(embedding)}, or set kv_pool_tokens"
            )
        if pool < ladders[s.name][-1]:  # one sequence can hold at most the pool
            ladders[s.name] = context_ladder(ladders[s.name], pool, bt)
        e = fixed[s.name]
        log.info(
            "model %s: paged KV pool of %d tokens (%.2f GB, %s, blocks of %d; prefix caching %s, in the pool's "
            "unheld blocks), up to %d sequences, each up to %d tokens (capacity buckets %s); weights %.2f GB, "
            "prefill %.2f GB, against %s %.2f GB",
            s.name, pool, pool * per / gb, kv_storage(s.kv_bits), bt, "on" if settings.prefix_cache_bytes else "off",
            resolved[s.name],
            ladders[s.name][-1], ladders[s.name], e.weights / gb, e.prefill / gb, name, limit / gb,
        )  # fmt: skip
    settings = _with_max_sequences(settings, resolved)
    settings = _with_model_values(settings, "capacity_buckets", ladders)
    return _with_model_values(settings, "kv_pool_tokens", pools)


KV_GROUP_SIZE = 64  # values of a head quantized together in a kv_bits pool (the executor's group size)


def kv_storage(bits: int | None) -> str:
    """How a paged pool keeps keys and values, for the start-up log: ``kv_bits 8`` or
    ``unquantized``."""
    return f"kv_bits {bits}" if bits else "unquantized"


def check_kv_heads(settings: Settings, spec: ServedModel, model: LoadedModel) -> None:
    """Refuse a ``kv_bits`` that ``model`` cannot take: its pool quantizes groups of
    :data:`KV_GROUP_SIZE` values of a head, so the head dim must be a multiple of it; and a
    model served by mlx-lm's class must attend over quantized keys through mlx-lm's
    ``scaled_dot_product_attention`` (:func:`service.engine.executor.adapter_kv_bits_error`:
    one eager step over a quantized pool; not mlx-lm's gemma2, whose attention reads the keys
    itself, nor a class in a pipeline group).

    Raises:
        ModelLoadError: naming the model, the key that set the bits (its ``[[models]]`` entry's
            ``models[N].kv_bits`` or the top-level ``kv_bits``), the head dim or the class and
            why, and the fix.
    """
    if spec.kv_bits is None:
        return
    head_dim = getattr(model.args, "dim_per_head", None)
    fits = head_dim is not None and head_dim % KV_GROUP_SIZE == 0
    adapted = isinstance(model.args, AdapterArgs)
    why = adapter_kv_bits_error(model, spec.kv_bits, KV_GROUP_SIZE) if fits and adapted else None
    if fits and why is None:
        return
    entry = next((i for i, m in enumerate(settings.models) if m.name == spec.name and m.kv_bits is not None), None)
    where = f"models[{entry}].kv_bits" if entry is not None else "kv_bits"
    if entry is not None:
        fix = "remove kv_bits from its [[models]] entry"
    elif settings.models:
        where += " (top level)"
        fix = "remove the top-level kv_bits and set kv_bits on the [[models]] entries of the models that take it"
    else:
        fix = "remove kv_bits"
    if why is not None:
        raise ModelLoadError(
            f"model '{spec.name}': {where} = {spec.kv_bits} is not implemented for {_served_by(model)}: {why}; {fix}"
        )
    raise ModelLoadError(
        f"model '{spec.name}': {where} = {spec.kv_bits} quantizes groups of {KV_GROUP_SIZE} values of a head, "
        f"but its head dim is {head_dim}, not a multiple of {KV_GROUP_SIZE}; {fix}"
    )


def _embedding_fix(embedding: list[memory.EmbeddingEstimate]) -> str:
    """The refusal's fix for the embedding models, naming them ("" without any)."""
    if not embedding:
        return ""
    return f", lower the largest batch bucket of an embedding model ({', '.join(e.model for e in embedding)})"


def _per_model(settings: Settings, model: str, key: str) -> bool:
    """Whether ``model``'s ``[[models]]`` entry sets ``key`` itself."""
    return any(m.name == model and getattr(m, key) is not None for m in settings.models)


def with_pool_tokens(settings: Settings, pool: int, max_sequences: int) -> Settings:
    """``settings`` (one served model's, resolved by :func:`check_memory` with ``kv_cache =
    'paged'``) with that model's ``kv_pool_tokens`` set to ``pool`` (a pipeline group's: the
    least any rank's memory holds, so that every rank holds as many blocks), its capacity
    ladder cut to what such a pool holds for one sequence (:func:`context_ladder`) and its
    ``max_sequences`` set (the least any rank allows)."""
    spec = settings.served_models()[0]
    ladder = list(spec.capacity_buckets)
    if pool < ladder[-1]:
        ladder = context_ladder(ladder, pool, settings.kv_block_tokens)
    settings = _with_model_values(settings, "capacity_buckets", {spec.name: ladder})
    settings = _with_max_sequences(settings, {spec.name: max_sequences})
    return _with_model_values(settings, "kv_pool_tokens", {spec.name: pool})


def _with_model_values(settings: Settings, key: str, values: dict) -> Settings:
    """``settings`` with each model's ``key`` set to ``values[name]`` (the top level's, for one model)."""
    if not settings.models:
        return settings.model_copy(update={key: values[settings.model_name]})
    models = [m.model_copy(update={key: values.get(m.name, getattr(m, key))}) for m in settings.models]
    return settings.model_copy(update={"models": models})


def apply_memory_limit(settings: Settings) -> int | None:
    """Set MLX's memory limit (``mx.set_memory_limit``) for this process: to
    ``mlx_memory_limit_bytes`` when set, else to ``memory_budget_bytes`` when set and below
    MLX's own limit. Returns the limit set, or None (MLX's default kept).

    MLX releases a step's intermediate buffers only once the device has run the work that reads
    them, so a queued step can hold far more than the start-up estimate counts for one layer;
    under its limit, MLX's evaluation waits for running work before queueing more (MLX's
    ``eval_impl``), which keeps a process near its budget instead of growing until the device
    runs out. The limit does not make an allocation fail (see :mod:`service.process.memory`)."""
    if settings.mlx_memory_limit_bytes:
        mx.set_memory_limit(settings.mlx_memory_limit_bytes)
        return settings.mlx_memory_limit_bytes
    if settings.memory_budget_bytes and settings.memory_budget_bytes < mx.get_memory_limit():
        mx.set_memory_limit(settings.memory_budget_bytes)
        return settings.memory_budget_bytes
    return None


def memory_budget(settings: Settings) -> int:
    """Bytes the models may use: ``memory_budget_bytes``, else ``mlx_memory_limit_bytes``, else
    MLX's memory limit."""
    budget = _budget(settings)[1]
    return budget if budget is not None else mx.get_memory_limit()


def _budget(settings: Settings) -> tuple[str, int | None]:
    if settings.memory_budget_bytes:
        return "memory_budget_bytes", settings.memory_budget_bytes
    if settings.mlx_memory_limit_bytes:
        return "mlx_memory_limit_bytes", settings.mlx_memory_limit_bytes
    return "MLX's memory limit", None


def _with_max_sequences(settings: Settings, resolved: dict[str, int]) -> Settings:
    return _with_model_values(settings, "max_sequences", resolved)


CPU_WARMUP_PROMPT_TOKENS = 512  # the CPU ceiling: warming every prompt length there takes minutes
CPU_WARMUP_BATCH = 4


def warmup_extent(spec: ServedModel, model: LoadedModel, settings: Settings, max_running: int) -> Coverage:
    """What the warm-up of ``spec`` covers (prompt tokens, concurrent requests), and why; logged.

    A setting (``warmup_prompt_tokens``, ``warmup_batch``) wins. Unset ones cover everything on
    a GPU: every prompt length up to the largest capacity bucket and every concurrency up to
    ``max_running``. On the CPU, where running each planned step once dominates the warm-up and
    its cost follows the BLAS (docs/BENCHMARKS.md, "Warm-up"), one matmul is timed and the
    largest extent up to prompts of :data:`CPU_WARMUP_PROMPT_TOKENS` and :data:`CPU_WARMUP_BATCH`
    requests whose estimated compute fits ``warmup_budget_s`` is chosen, the rehearsals
    (``warmup_rehearsal``, unless set) dropped first (:func:`service.process.warm_sizing.size_extent`);
    the buckets left cold run eagerly when first used, never compiling on a request's time.
    """
    buckets = buckets_of(spec, model)
    limit = buckets.capacity[-1]
    if device_name() == "gpu":
        prompt = limit if spec.warmup_prompt_tokens is None else spec.warmup_prompt_tokens
        batch = spec.warmup_batch or max_running
        coverage = Coverage(prompt, batch, settings.warmup_rehearsal, reason="a GPU: every bucket, unless set")
    elif spec.warmup_prompt_tokens is not None and spec.warmup_batch is not None:
        reason = "warmup_prompt_tokens and warmup_batch set"
        coverage = Coverage(
            spec.warmup_prompt_tokens, spec.warmup_batch, settings.warmup_rehearsal, reason=reason, blas=cpu_blas()
        )
    else:
        top = min(CPU_WARMUP_PROMPT_TOKENS, limit)
        ceiling = WarmupSpec(
            top,
            min(CPU_WARMUP_BATCH, max_running),
            top + settings.default_max_tokens,
            buckets.chunk_tokens(settings.prefill_chunk_tokens),
            settings.max_batched_tokens,
            settings.warmup_rehearsal,
        )
        gflops = warm_sizing.measure_gflops(model.args.hidden_size, model.args.intermediate_size, model.dtype)
        verify = spec.speculative_tokens + 1 if spec.speculative != "off" else 0
        rehearse = settings.warmup_rehearsal if "warmup_rehearsal" in settings.model_fields_set else None
        sized = warm_sizing.size_extent(
            model.args,
            buckets,
            ceiling,
            gflops,
            settings.warmup_budget_s,
            spec.warmup_prompt_tokens,
            spec.warmup_batch,
            rehearse,
            verify,
        )
        coverage = dataclasses.replace(sized, blas=cpu_blas())
    _log_coverage(spec.name, coverage)
    return coverage


def _log_coverage(name: str, coverage: Coverage) -> None:
    what = (
        f"prompts of up to {coverage.prompt_tokens} tokens, {coverage.batch} concurrent requests"
        if coverage.prompt_tokens
        else "nothing"
    )
    host = "" if coverage.blas is None else f"; CPU BLAS {coverage.blas}"
    host += "" if coverage.gflops is None else f", {coverage.gflops:.1f} GFLOP/s measured"
    if coverage.reduced:
        beyond = "; buckets beyond it run eagerly" if coverage.prompt_tokens else ""
        fix = f"; to fix: {OPENBLAS_FIX}" if coverage.blas == "reference" else ""
        log.warning(
            "model %s: warm-up reduced for this host to %s (%s%s)%s%s", name, what, coverage.reason, host, beyond, fix
        )
    else:
        log.info("model %s: warm-up covers %s (%s%s)", name, what, coverage.reason, host)


def log_cpu_blas() -> None:
    """Log which BLAS MLX's CPU matmuls use; warn, with the fix, when it is the reference BLAS."""
    if device_name() != "cpu":
        return
    blas = cpu_blas()
    if blas == "reference":
        log.warning(
            "CPU BLAS: MLX's bundled reference BLAS, far slower for dense float32 matmuls than OpenBLAS "
            "(docs/BENCHMARKS.md); to fix: %s",
            OPENBLAS_FIX,
        )
    else:
        log.info("CPU BLAS: %s", blas)
