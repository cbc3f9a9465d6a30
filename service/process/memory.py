"""Memory: one formula for what a model may hold, used both for the start-up estimate and
for admitting each request.

``mx.set_memory_limit`` does not make an allocation fail in MLX 0.32: in MLX's source the
limit throttles evaluation (``eval_impl`` waits for running work while active memory is over
it) and the CPU allocator (``CommonAllocator::malloc``) never reads it, and an allocation
larger than physical memory kills the process (``malloc`` returns NULL and is written
through). So stepserve never relies on it: it refuses to start a configuration that could
need more than the budget, and admits requests against the same estimate (HTTP 503 when a
request would take the served models past MLX's memory limit): a chat request
(:func:`admit`) and an embedding request (:func:`admit_embedding`) are each counted with what
every chat model and every embedding model may hold at the time (:func:`load_bytes`,
:func:`embedder_load_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from models.adapter import AdapterArgs
from models.loader import LoadedModel
from models.sentence import EmbeddingModel
from service.engine.buckets import BucketTable
from service.engine.core import Engine
from service.engine.embedder import Embedder, pick
from service.engine.executor import batches_last_chunks, prefills_in_blocks
from service.engine.prefill import last_chunk_rows

SCORES_BYTES = 4  # float32 attention scores: MLX's fallback attention materializes B x heads x T x T of them


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one model may hold.

    Attributes:
        model: the model's name.
        weights: the parameters.
        decode_cache: the decode KV cache at (batch bucket, capacity bucket); counted twice in
            ``total``, since a bucket move holds the old and the new cache (and a prompt being
            prefilled in chunks holds a staging row instead of a decode row).
        prefill: the largest prefill step's KV cache plus its float32 attention scores.
        prefix_cache: the prefix cache's budget (``prefix_cache_bytes``).
    """

    model: str
    weights: int
    decode_cache: int
    prefill: int
    prefix_cache: int = 0

    @property
    def total(self) -> int:
        return self.weights + 2 * self.decode_cache + self.prefill + self.prefix_cache

    def describe(self) -> str:
        gb = 1e9
        return (
            f"model '{self.model}': {self.total / gb:.2f} GB = weights {self.weights / gb:.2f} GB"
            f" + 2 x decode KV cache {self.decode_cache / gb:.2f} GB + prefill {self.prefill / gb:.2f} GB"
            f" + prefix cache {self.prefix_cache / gb:.2f} GB"
        )


@dataclass(frozen=True)
class EmbeddingEstimate:
    """Bytes one embedding model may hold: its weights and its largest encoder step.

    Attributes:
        model: the embedding model's name.
        weights: the parameters.
        step: the activations of its largest step (:meth:`models.bert.BertArgs.step_bytes`),
            at ``batch`` x ``length``.
        batch: its largest batch bucket.
        length: its largest length bucket (the longest input it accepts).
    """

    model: str
    weights: int
    step: int
    batch: int
    length: int

    @property
    def total(self) -> int:
        return self.weights + self.step

    def describe(self) -> str:
        gb = 1e9
        return (
            f"embedding model '{self.model}': {self.total / gb:.2f} GB = weights {self.weights / gb:.2f} GB"
            f" + largest step b{self.batch}x{self.length} {self.step / gb:.2f} GB"
        )


def embedding_worst_case(
    model: EmbeddingModel, batch_buckets: Sequence[int], lengths: Sequence[int]
) -> EmbeddingEstimate:
    """The most embedding ``model`` can hold: its weights and one step at its largest batch
    bucket and its largest length bucket (ascending ``batch_buckets`` and ``lengths``, as its
    :class:`service.engine.embedder.Embedder` gets them; a step holds at most the largest of
    each, compiled or eager). Steps run one at a time, on its own thread."""
    batch, length = batch_buckets[-1], lengths[-1]
    return EmbeddingEstimate(model.name, model.nbytes, embedding_step_bytes(model, batch, length), batch, length)


def embedding_step_bytes(model: EmbeddingModel, batch: int, length: int) -> int:
    """Bytes of the activations of one encoder step of ``model`` on a padded [``batch``,
    ``length``] batch, beside its weights (:meth:`models.bert.BertArgs.step_bytes` at its
    compute dtype)."""
    return model.args.step_bytes(batch, length, model.dtype.size)


def embedder_load_bytes(embedder: Embedder, lengths: Sequence[int]) -> int:
    """Bytes ``embedder``'s model may hold while it has inputs of ``lengths`` tokens queued or in
    its step: its weights and the largest step they could make (steps run one at a time): the
    batch bucket of as many of them as one step takes, at the length bucket of the longest. A
    bound from above (the longest input may not share a step with the most others). Just the
    weights when ``lengths`` is empty."""
    model = embedder.model
    if not lengths:
        return model.nbytes
    batch = pick(embedder.batch_buckets, min(len(lengths), embedder.batch_buckets[-1]))
    return model.nbytes + embedding_step_bytes(model, batch, pick(embedder.lengths, max(lengths)))


class MemoryAdmissionError(RuntimeError):
    """A request could take MLX past its memory limit (HTTP 503).

    Attributes:
        message: what was needed against what limit, and the fix.
        retry: True when the request would fit on an idle server (it is the current load
            that does not): the client may retry later.
    """

    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.message, self.retry = message, retry


def kv_bytes_per_position(model: LoadedModel) -> int:
    """Bytes one row of a linear (prefill or staging) KV cache takes per position in this
    process: keys and values of every layer it holds (all, or a pipeline stage's),
    2 x layers x Hkv x D x the compute dtype's size. A recurrent layer's state is a row's
    whatever its length (:func:`state_bytes_per_row`), not a position's."""
    return _row_bytes(model, 1, ring=False) - state_bytes_per_row(model)


def state_bytes_per_row(model: LoadedModel) -> int:
    """Bytes of one row's recurrent states in this process (a gated delta net's or a
    Mamba layer's state and convolution window, :class:`models.adapter.AdapterArgs`), the
    same at any length: a cache at 0 positions. 0 for a model of attention layers only."""
    return _row_bytes(model, 0, ring=False)


def pool_bytes_per_position(model: LoadedModel, bits: int | None = None, group_size: int = 64) -> int:
    """Bytes a paged pool takes per token position: :func:`kv_bytes_per_position`, or with
    ``bits`` the quantized layout's (``bits / 8`` bytes per value plus a scale and a bias of the
    compute dtype per ``group_size`` values, mlx-lm's ``QuantizedKVCache``)."""
    full, item = kv_bytes_per_position(model), model.dtype.size
    if not bits:
        return full
    return -(-full * (bits * group_size + 16 * item) // (8 * group_size * item))


def decode_row_bytes(model: LoadedModel, capacity: int) -> int:
    """Bytes one row of the decode KV cache takes at ``capacity`` positions in this process:
    each held full layer's keys and values at ``capacity``, a sliding-window layer's at
    min(window, ``capacity``) (its ring, as :meth:`models.model_args.ModelArgs.kv_bytes`)."""
    return _row_bytes(model, capacity, ring=True)


def _row_bytes(model: LoadedModel, capacity: int, ring: bool) -> int:
    """One row's KV bytes at ``capacity`` over the layers this process holds."""
    stage = model.stage  # an mlx-lm stage's layouts are its own layers' already
    layers = range(stage.start, stage.stop) if stage is not None and not isinstance(model.args, AdapterArgs) else None
    return model.args.kv_bytes(capacity, model.dtype.size, ring, layers)


def prefill_bytes(
    model: LoadedModel,
    buckets: BucketTable,
    rows: int,
    prompt: int,
    chunk_tokens: int,
    max_batched_tokens: int,
    batched: bool = False,
    in_blocks: bool = False,
) -> int:
    """Bytes of the largest prefill call for up to ``rows`` requests of up to ``prompt`` tokens:
    a whole prefill of as many prompts of one bucket as one call runs (their KV cache, their
    recurrent states if any, and float32 attention scores, rows x heads x T x T), or one chunk
    of a longer prompt (heads x T x C scores against its staging cache, C the capacity it
    needs, and the row's states); with ``batched``, the last
    chunks of several prompts in one call (:func:`service.engine.prefill.last_chunk_rows` rows
    at chunk bucket t: a copy of their staging rows, B x C positions, and B x heads x t x C
    scores).

    ``in_blocks``: the model prefills straight into a paged pool's blocks
    (:func:`service.engine.executor.prefills_in_blocks`), whose bytes are counted as the pool's:
    a chunk then holds no staging rows (nor copies of them), only one layer's gathered view of
    its rows' blocks at a time (keys and values, C positions: :func:`kv_bytes_per_position`
    over the layers) beside its activations and scores."""
    per_position, heads = kv_bytes_per_position(model), model.args.num_attention_heads
    state = state_bytes_per_row(model)
    chunk_tokens = buckets.chunk_tokens(chunk_tokens)  # as the engine caps it
    T = buckets.prompt_for(min(prompt, chunk_tokens))
    admitted = buckets.batch_for(max(1, min(rows, max_batched_tokens // max(1, T // 2))))
    whole_rows = min(admitted, buckets.prefill_rows(T, chunk_tokens))
    whole = whole_rows * (state + T * (per_position + heads * T * SCORES_BYTES))
    if prompt <= chunk_tokens:
        return whole
    C = buckets.staging_for(min(prompt + T, buckets.capacity[-1]))
    view = C * per_position // model.layers if in_blocks else 0  # one layer's keys and values at C
    chunk = state + T * per_position + view + heads * T * C * SCORES_BYTES
    if batched:
        budget = max(max_batched_tokens, chunk_tokens)
        held = view if in_blocks else C * per_position  # a row's view of its blocks, or its staging row's copy
        for t in (b for b in buckets.prompt if b <= T):
            B = min(last_chunk_rows(buckets, t, budget, staging=C), buckets.batch_for(max(1, rows)))
            step = B * (state + held + heads * t * C * SCORES_BYTES + (t * per_position if in_blocks else 0))
            chunk = max(chunk, step)
    return max(whole, chunk)


def paged_pool_tokens(
    model: LoadedModel,
    buckets: BucketTable,
    max_running: int,
    chunk_tokens: int,
    max_batched_tokens: int,
    prefix_cache_bytes: int,
    budget: int,
    bits: int | None = None,
) -> int:
    """Token positions a paged KV pool of ``model`` gets from ``budget`` bytes: what is left after
    the weights, the largest prefill step (:func:`prefill_bytes`, for ``max_running`` rows; in
    the pool's blocks where the model prefills there, :func:`prefills_in_blocks`) and the prefix
    cache's budget, at :func:`pool_bytes_per_position` each (every layer's keys and values: a
    paged pool keeps a sliding layer's positions too; ``bits``: quantized). 0 when nothing is
    left."""
    C, in_blocks = buckets.capacity[-1], prefills_in_blocks(model, bits)
    batched = batches_last_chunks()
    prefill = prefill_bytes(model, buckets, max_running, C, chunk_tokens, max_batched_tokens, batched, in_blocks)
    left = budget - model.nbytes - prefill - prefix_cache_bytes
    return max(0, left // pool_bytes_per_position(model, bits))


def worst_case(
    model: LoadedModel,
    buckets: BucketTable,
    max_running: int,
    chunk_tokens: int = 512,
    max_batched_tokens: int = 2048,
    prefix_cache_bytes: int = 0,
    in_blocks: bool = False,
) -> MemoryEstimate:
    """The most ``model`` can hold: ``max_running`` rows at the largest capacity bucket, the
    largest prefill step (:func:`prefill_bytes`; ``in_blocks``: a paged pool's model that
    prefills in its blocks) and the prefix cache's whole budget."""
    C = buckets.capacity[-1]
    decode = buckets.batch_for(max_running) * decode_row_bytes(model, C)
    batched = batches_last_chunks()
    prefill = prefill_bytes(model, buckets, max_running, C, chunk_tokens, max_batched_tokens, batched, in_blocks)
    return MemoryEstimate(model.name, model.nbytes, decode, prefill, prefix_cache_bytes)


def load_bytes(engine: Engine, rows: list[tuple[int, int]]) -> int:
    """Bytes ``engine``'s model may hold while serving ``rows`` of (prompt tokens, max_tokens):
    the rows that can run at once at the capacity bucket of the longest prompt + max_tokens,
    and the largest prefill step among them (:func:`prefill_bytes`). Requests may stop early,
    so this bounds the load from above. The prefix cache is left out: it is evicted first. A
    paged engine holds its pool instead of the rows' caches, whatever the rows."""
    if not rows:
        return engine.model.nbytes
    buckets, sched = engine.buckets, engine.scheduler
    running = min(len(rows), sched.max_running)
    capacity = buckets.capacity_for(min(max(p + m for p, m in rows), buckets.capacity[-1]))
    decode = buckets.batch_for(running) * decode_row_bytes(engine.model, capacity)
    longest = max(p for p, _ in rows)
    batched, in_blocks = engine.executor.batches_chunks, engine.executor.in_blocks
    prefill = prefill_bytes(
        engine.model, buckets, running, longest, sched.chunk_tokens, sched.max_batched_tokens, batched, in_blocks
    )
    if engine.executor.pool is not None:  # a paged pool is allocated once; its blocks admit the requests
        return engine.model.nbytes + engine.executor.pool.nbytes + prefill
    return engine.model.nbytes + 2 * decode + prefill


def admit(
    engines: Iterable[Engine],
    engine: Engine,
    prompt_tokens: int,
    max_tokens: int,
    embedders: Iterable[Embedder] = (),
) -> None:
    """Refuse a chat request whose admission could take MLX past its memory limit.

    The limit is ``mx.get_memory_limit()`` (``mlx_memory_limit_bytes`` when set, else MLX's
    default); the need is :func:`load_bytes` summed over every served chat model, with this
    request added to ``engine``'s load, plus :func:`embedder_load_bytes` of every embedding
    model (its weights, and its step while it has inputs to embed). A request that fits only
    without the prefix cache's blocks is admitted, and ``engine`` evicts that many bytes of them
    at its next step.

    Raises:
        MemoryAdmissionError: naming the need and the limit; ``retry`` when the request would
            fit on an idle server.
    """
    engines, embedders = list(engines), list(embedders)
    request = (prompt_tokens, max_tokens)
    need = sum(load_bytes(e, e.load() + ([request] if e is engine else [])) for e in engines)
    need += sum(embedder_load_bytes(x, x.load()) for x in embedders)
    alone = sum(e.model.nbytes for e in engines if e is not engine) + sum(x.model.nbytes for x in embedders)
    alone += load_bytes(engine, [request])
    what = f"this request (prompt {prompt_tokens} tokens, max_tokens {max_tokens})"
    _settle(need, alone, engines, [engine], what, "lower max_tokens or shorten the prompt")


def admit_embedding(
    engines: Iterable[Engine], embedders: Iterable[Embedder], embedder: Embedder, lengths: Sequence[int]
) -> None:
    """Refuse an embedding request (inputs of ``lengths`` tokens, at least one) whose admission
    could take MLX past its memory limit: as :func:`admit`, the need counting every chat model's
    load and every embedding model's, this request's inputs added to ``embedder``'s queue. A
    request that fits only without the prefix caches' blocks is admitted, and the chat models
    evict that many bytes of them (the largest caches first) at their next step.

    Raises:
        MemoryAdmissionError: naming the need and the limit; ``retry`` when the request would
            fit on an idle server.
    """
    engines, embedders = list(engines), list(embedders)
    need = sum(load_bytes(e, e.load()) for e in engines)
    need += sum(embedder_load_bytes(x, x.load() + (list(lengths) if x is embedder else [])) for x in embedders)
    alone = sum(e.model.nbytes for e in engines) + sum(x.model.nbytes for x in embedders if x is not embedder)
    alone += embedder_load_bytes(embedder, lengths)
    what = f"this request ({len(lengths)} inputs, the longest {max(lengths)} tokens)"
    _settle(need, alone, engines, engines, what, "send fewer or shorter inputs per request")


def _settle(need: int, alone: int, engines: list[Engine], evictors: list[Engine], what: str, fix: str) -> None:
    """Admit a request whose admission needs ``need`` bytes of the served models (``alone``: on
    an idle server) against ``mx.get_memory_limit()``: when it fits only without the prefix
    caches' blocks (every engine's), ``evictors`` (the largest caches first) evict the excess;
    else raise :class:`MemoryAdmissionError` (``what`` the request, ``fix`` what to change)."""
    limit = mx.get_memory_limit()
    if need <= limit:
        excess = need + sum(e.prefix_cache_bytes for e in engines) - limit
        for e in sorted(evictors, key=lambda e: e.prefix_cache_bytes, reverse=True):
            if excess <= 0:  # the prefix caches give way before any request is refused
                break
            e.shrink_prefix_cache(excess)
            excess -= e.prefix_cache_bytes
        return
    if alone > limit:
        raise MemoryAdmissionError(
            f"not enough memory: {what} could need {alone / 1e9:.2f} GB even alone, over MLX's memory limit of "
            f"{limit / 1e9:.2f} GB; {fix}",
            retry=False,
        )
    raise MemoryAdmissionError(
        f"not enough memory now: with the requests already running or waiting this one could need "
        f"{need / 1e9:.2f} GB, over MLX's memory limit of {limit / 1e9:.2f} GB; retry later",
        retry=True,
    )
