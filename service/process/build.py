"""The one builder of an engine from settings: the compile cache, the bucket table, the prefix
cache and speculative decoding's proposer as the settings say, the engine (which composes its
parts), its warm-up plan's extent, and the start of its thread with the warm-up driver.
``stepserve serve`` (:mod:`service.api.app`), the offline entry point (:mod:`service.offline`),
the benchmarks and the tests all build engines here."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

from prometheus_client import CollectorRegistry

from models import paged_kernel
from models.loader import LoadedModel, device_name
from models.sentence import EmbeddingModel
from service import __version__
from service.config import ServedModel, Settings, load_settings
from service.engine.compile_cache import CompileCache
from service.engine.core import Engine
from service.engine.draft import DraftProposer
from service.engine.embedder import Embedder, length_buckets
from service.engine.executor import pool_verifies
from service.engine.lookup import PromptLookup
from service.engine.prefix_cache import PrefixCache
from service.engine.warmup import WarmupSpec
from service.metrics import Metrics
from service.process import memory, warmer
from service.process.startup import buckets_of, memory_budget, warmup_extent
from service.process.warm_sizing import Coverage

log = logging.getLogger("stepserve")


def build_engine(
    settings: Settings, served: ServedModel, model: LoadedModel, metrics: Metrics, draft: LoadedModel | None = None
) -> Engine:
    """``model``'s engine as ``settings`` and its ``served`` entry (:meth:`Settings.served_models`)
    say, not started: its compile cache (recording into ``metrics``), buckets, prefix cache,
    running and waiting limits, prefill chunk and step token budget, and speculative decoding
    (``draft``: the draft model, with ``speculative = 'draft'``)."""
    cache = CompileCache(served.compile, metrics.record_lookup, metrics.record_compile)
    buckets = buckets_of(served, model)
    prefix = PrefixCache(settings.prefix_block_tokens, prefix_budget(model, settings.prefix_cache_bytes))
    chunk_tokens = buckets.chunk_tokens(settings.prefill_chunk_tokens)  # the engine's chunk, for the draft's steps
    proposer: PromptLookup | DraftProposer | None = None
    # Rings and states decode plain (load_models); the paged pool's view is linear, so a model with
    # sliding-window layers verifies there (a hand-written family's or mlx-lm's class: pool_verifies).
    paged = settings.kv_cache == "paged"
    paged_kernel.enable(settings.paged_attention_kernel)  # before any paged step is traced
    if served.speculative != "off" and (pool_verifies(model) if paged else model.args.can_verify):
        proposer = PromptLookup() if draft is None else DraftProposer(draft, buckets, cache, chunk_tokens)
    engine = Engine(
        model,
        buckets,
        cache,
        metrics,
        settings.max_waiting,
        served.max_sequences,
        chunk_tokens,
        settings.max_batched_tokens,
        prefix,
        proposer,
        served.speculative_tokens,
        served.speculative_max_batch,
        paged_pool_tokens(settings, served, model) if settings.kv_cache == "paged" else None,
        settings.kv_block_tokens,
        served.kv_bits,
    )
    if proposer is not None:
        metrics.init_speculative(model.name, proposer.method)
    log.info(
        "model %s: %s, %.0f MB, %s weights, %s compute, compile %s",
        model.name,
        model.path,
        model.nbytes / 1e6,
        model.weights,
        model.dtype,
        served.compile,
    )
    return engine


def paged_pool_tokens(settings: Settings, served: ServedModel, model: LoadedModel) -> int:
    """Token positions of ``model``'s paged KV pool: its ``kv_pool_tokens`` (as start-up
    resolved it, :func:`service.process.startup.check_memory`), else what the memory budget
    leaves after the weights and the largest prefill step
    (:func:`service.process.memory.paged_pool_tokens`; the prefix cache is the pool's own
    cached blocks, with no budget of its own)."""
    if served.kv_pool_tokens is not None:
        return served.kv_pool_tokens
    return memory.paged_pool_tokens(
        model,
        buckets_of(served, model),
        served.max_sequences or served.batch_buckets[-1],
        settings.prefill_chunk_tokens,
        settings.max_batched_tokens,
        0,  # the pool's cached blocks are the prefix cache: no budget of its own
        memory_budget(settings),
        served.kv_bits,
    )


def prefix_budget(model: LoadedModel, budget: int) -> int:
    """The prefix cache's bytes for ``model``: ``budget``, or 0 (logged with the reason) where
    its blocks cannot be kept (:attr:`models.adapter.AdapterArgs.prefix_blocks`): a recurrent
    state cannot be cut at a block boundary, and the blocks stack every layer's keys and values
    in one shape."""
    if budget and not model.args.prefix_blocks:
        why = (
            "its recurrent state cannot be cut at a block boundary"
            if model.args.has_states
            else "its attention caches are not all of one shape with keys as wide as values"
        )
        log.info("model %s: prefix cache off (%s)", model.name, why)
        return 0
    return budget


def warmup_spec(settings: Settings, served: ServedModel, engine: Engine) -> tuple[WarmupSpec, Coverage]:
    """What ``engine``'s warm-up covers, and why (:func:`service.process.startup.warmup_extent`,
    sized to the host on the CPU): its prompt tokens and concurrency, the capacities batches of
    more than one row reach (prompt plus ``default_max_tokens``), the engine's chunk and step
    budget, and the rehearsal."""
    capacity_limit = engine.buckets.capacity[-1]
    coverage = warmup_extent(served, engine.model, settings, engine.scheduler.max_running)
    prompt_tokens, batch = coverage.prompt_tokens, coverage.batch
    positions = None if prompt_tokens >= capacity_limit else prompt_tokens + settings.default_max_tokens
    spec = WarmupSpec(
        prompt_tokens,
        batch,
        positions,
        engine.scheduler.chunk_tokens,
        settings.max_batched_tokens,
        coverage.rehearse,
    )
    return spec, coverage


def start_engine(
    engine: Engine,
    spec: WarmupSpec,
    progress: Callable[[int, str], None] | None = None,
    http_rehearsal: Callable[[], Future[list[str]]] | None = None,
) -> Engine:
    """Start ``engine``'s thread: it warms up as ``spec`` says (:func:`service.process.warmer.warm_up`;
    ``progress`` and ``http_rehearsal`` as there), then serves. Returns ``engine``."""
    engine.start(partial(warmer.warm_up, spec=spec, progress=progress, http_rehearsal=http_rehearsal))
    return engine


def engine_for(
    model: LoadedModel,
    settings: Settings | None = None,
    metrics: Metrics | None = None,
    draft: LoadedModel | None = None,
) -> Engine:
    """``model``'s engine, not started, as ``settings`` (default: :func:`load_settings`'s) say for their
    first served model (:func:`build_engine`), recording into ``metrics`` (default: a fresh
    registry): an engine for one loaded model, as the benchmarks and tests build them."""
    settings = settings if settings is not None else load_settings()
    if metrics is None:
        metrics = Metrics(CollectorRegistry(), version=__version__, device=device_name())
    return build_engine(settings, settings.served_models()[0], model, metrics, draft)


CPU_EMBED_WARMUP_TOKENS = 4096  # on the CPU, buckets up to this many padded tokens are warmed by default


def build_embedder(served: ServedModel, model: EmbeddingModel, metrics: Metrics) -> Embedder:
    """An embedding model's engine, not started: its own compile cache (``served.compile``),
    batch buckets ``served.batch_buckets`` and length buckets from ``served.prompt_buckets`` up
    to the model's longest input (:func:`service.engine.embedder.length_buckets`)."""
    cache = CompileCache(served.compile, metrics.record_lookup, metrics.record_compile)
    lengths = length_buckets(served.prompt_buckets, model.max_tokens)
    return Embedder(model, tuple(served.batch_buckets), lengths, cache, metrics)


def embed_warmup(served: ServedModel, embedder: Embedder) -> list[tuple[int, int]]:
    """The (batch, length) buckets warm-up compiles: those within ``warmup_batch`` and
    ``warmup_prompt_tokens`` where set; where unset, every bucket on a GPU and, on the CPU,
    those of at most ``CPU_EMBED_WARMUP_TOKENS`` padded tokens (others run eagerly)."""
    cpu = device_name() == "cpu"
    return [
        (b, t)
        for b in embedder.batch_buckets
        for t in embedder.lengths
        if (served.warmup_batch is None or b <= served.warmup_batch)
        and (served.warmup_prompt_tokens is None or t <= served.warmup_prompt_tokens)
        and not (cpu and None in (served.warmup_batch, served.warmup_prompt_tokens) and b * t > CPU_EMBED_WARMUP_TOKENS)
    ]
