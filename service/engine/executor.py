"""The executor: where the runner's model steps and KV-cache operations run.

The runner decides (which rows, which bucket, which slots); the executor carries it out on
this process's layers. Every method here is one **operation**: a compiled model step
(``prefill``, ``chunk``, ``decode``, each at a bucketed shape), or a KV-cache operation
(``alloc``, ``resize``, ``reorder``, ``resize_batch``, ``insert_rows``, the prefix cache's
``save_blocks`` and ``gather_blocks``, the paged pool's ``use_paged``, ``write_blocks``,
``read_blocks`` and ``copy_pool_blocks``), or a warm-up step.

In one process (:class:`Executor`) an operation is a direct call on the whole model. In a
pipeline group (:mod:`service.engine.group`) rank 0's executor first tells every other rank the
operation and its inputs, then runs it on its own stage; each other rank runs the same method
of its own :class:`Executor` on its stage: the same compile-cache key, the same shapes, its own
layers' caches. So the runner and the prefiller never branch on distribution: they call this
API, whose inputs are host integers and int32 arrays.

Shapes: B batch rows (a batch bucket), T prompt tokens (a prompt bucket), C capacity (a
capacity bucket), Hkv key-value heads, D head dim, V vocabulary. A ``KVCache`` holds this
process's layers only (:attr:`models.loader.LoadedModel.layers`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple, TypeVar

import mlx.core as mx

from models import adapter, pipeline, sampling
from models.adapter import AdapterArgs
from models.architectures import architecture
from models.kv_cache import KVCache, Windows
from models.loader import LoadedModel
from models.paged import PagedKV, gather, gather_quantized, view_index
from service.engine.block_pool import NULL_BLOCK, BlockCopy
from service.engine.compile_cache import CompileCache, StepKey, StepSpec
from service.engine.kv_blocks import copy_blocks, join_blocks

log = logging.getLogger("stepserve.engine")

MODEL_PHASES = ("prefill", "chunk", "decode")  # run by every rank of a group; the rest only where the head is


def rows_at_bucket(logits: mx.array, rows: int) -> mx.array:
    """``logits`` [n, V] of a call run at its prompts' own shape (:attr:`Executor.exact_prefill`)
    as [rows, V], rows n.. repeating row 0: the first tokens are sampled at the batch bucket,
    as warmed up, and a padding row's is never read."""
    n = logits.shape[0]
    return logits if n == rows else logits[mx.array(list(range(n)) + [0] * (rows - n), mx.int32)]


def batches_last_chunks() -> bool:
    """Whether this process runs several prompts' last chunks in one call (:meth:`Executor.chunk_rows`):
    on a GPU, where each compiled call is hundreds of kernel launches of host work; not on a CPU,
    whose steps are compute-bound and where the extra (B, T, C) functions doubled the default
    warm-up (docs/ARCHITECTURE.md, "Last chunks together")."""
    return mx.default_device().type == mx.DeviceType.gpu


def waits_before_pool_writes() -> bool:
    """Whether this process waits for the device's work in flight before it queues writes into
    the paged pool (:meth:`Executor.wait_for_pool`): on a GPU, whose queued steps hold their
    inputs until they complete; not on a CPU, where MLX evaluates a stream's operations in order
    on the stream's thread, so the step before has let go of the pool when a scatter runs (the
    same peak memory with and without the wait, docs/BENCHMARKS.md, "Paged KV")."""
    return mx.default_device().type == mx.DeviceType.gpu


def pool_verifies(model: LoadedModel) -> bool:
    """Whether speculative decoding's verify step runs over the paged KV pool for ``model``, in
    one process: a hand-written family with a ``verify_paged``, or an mlx-lm module the pool
    holds at all (attention caches of one shape, no recurrent state: :attr:`Executor.can_page`;
    :func:`models.adapter.verify_paged`). Sliding-window layers included: the pool's view of a
    row is linear, so their window is a mask there and a verify step writes no ring."""
    a = model.args
    if model.stage is not None:
        return False
    if isinstance(a, AdapterArgs):
        return adapter_pages(a)
    return hasattr(architecture(a.model_type), "verify_paged")


def adapter_pages(args: AdapterArgs) -> bool:
    """Whether the paged pool holds an mlx-lm module's caches (:func:`models.adapter.decode_paged`
    and ``verify_paged`` serve it): every attention cache of one shape, keys as wide as values,
    no recurrent state, and at least one full-attention layer (no :attr:`AdapterArgs.capacity_pair`)."""
    return args.prefix_blocks and not args.capacity_pair


def adapter_kv_bits_error(model: LoadedModel, bits: int, group_size: int = 64) -> str | None:
    """Why an mlx-lm class (``model.args`` an :class:`AdapterArgs`) cannot decode over a
    ``bits``-bit quantized pool, or None where it can. Refused: caches no pool holds
    (:func:`adapter_pages`); a pipeline stage (its module's ``PipelineMixin`` would exchange
    hidden states in the probe below; quantized stages are the hand-written families'); a
    module whose attention does not attend over quantized keys through mlx-lm's
    ``scaled_dot_product_attention`` (:func:`models.adapter.quantized_attention_error`: one eager
    step, its answer kept per model, so a later memory check beside a model already serving,
    as an on-demand load's, does not run that model's module again off its engine thread).

    Raises:
        ValueError: a head dim that is not a multiple of ``group_size``
            (:func:`models.paged.quantized_pool`).
    """
    a = model.args
    assert isinstance(a, AdapterArgs)
    if not adapter_pages(a):
        return f"the paged pool does not hold the caches of mlx-lm's class of model type {a.model_type!r}"
    if model.stage is not None or model.group is not None:
        return f"mlx-lm's class of model type {a.model_type!r} keeps an unquantized pool in a pipeline group"
    return adapter.quantized_attention_error(a, bits, group_size, model.dtype)


def prefills_in_blocks(model: LoadedModel, bits: int | None) -> bool:
    """Whether prefill writes keys and values straight into the paged pool's blocks for
    ``model`` (:func:`models.llama.prefill_paged`: no staging cache, no copy at join): a
    hand-written family with a ``prefill_paged``, in one process, over a full-precision or a
    ``kv_bits`` pool (``bits``: its chunks attend over their own keys quantized, as mlx-lm's
    ``QuantizedKVCache`` has a prompt do). Everything else keeps the staging path (a linear
    cache per prompt, copied into its blocks at join): mlx-lm's classes, recurrent-state ones
    included (their module writes each layer's cache object, which goes back into the pool only
    after the whole module ran, so every layer's view would be held at once: a staging cache's
    bytes again), and a pipeline group's ranks (``--distributed``: a chunk is one broadcast
    operation moving a staging handle)."""
    a = model.args
    if model.stage is not None or model.group is not None or isinstance(a, AdapterArgs):
        return False
    return hasattr(architecture(a.model_type), "prefill_paged")


def pages(model: LoadedModel) -> bool:
    """Whether ``model``'s decode can read and write a paged KV pool: a hand-written family with a
    ``decode_paged``, or a pipeline stage of one (:func:`models.pipeline.decode_paged`), or an
    mlx-lm module (or its stage: its ``PipelineMixin`` passes the hidden states) the pool holds
    (:func:`adapter_pages`). A stage's pool holds its own layers."""
    a = model.args
    if isinstance(a, AdapterArgs):
        return adapter_pages(a)
    if model.stage is not None:
        return True  # the Llama decoder's stages (service.process.group.PIPELINE_TYPES)
    return hasattr(architecture(a.model_type), "decode_paged")


class PagedTables(NamedTuple):
    """A paged decode step's view of its rows: their block tables (int32 [batch, capacity /
    block_tokens], null-block padded) at a batch bucket and a capacity bucket; the pool itself
    is the executor's (:meth:`Executor.use_paged`)."""

    table: mx.array
    batch: int
    capacity: int


class InBlocks:
    """What a prefill straight into the pool (:meth:`Executor.prefill_blocks`) leaves where a
    staging cache would be (``seq.prefilled``'s cache): the keys and values are in the
    requests' blocks already, so :meth:`PagedDecodeBatch.join` copies nothing. One per call:
    requests of one call and row (a prompt sent twice) are told apart by it, as by a cache."""

    __slots__ = ()


#: What a decode step runs over: a static cache, or the rows' block tables into the paged pool.
DecodeCache = TypeVar("DecodeCache", KVCache, PagedTables)


class Executor:
    """This process's compiled steps and KV-cache operations (see the module doc).

    Args:
        model: the model, or one pipeline stage of it (``model.stage``; the stage steps of
            :mod:`models.pipeline` then pass hidden states over ``model.group``).
        cache: the compile cache (the only caller of ``mx.compile``).
    """

    def __init__(self, model: LoadedModel, cache: CompileCache):
        self.model, self.compiled = model, cache
        self.batches_chunks = batches_last_chunks()  # prompts' last chunks together (:meth:`chunk_rows`)
        a = model.args
        self._dtype_name = str(model.dtype).rsplit(".", 1)[-1]
        if isinstance(a, AdapterArgs):  # an mlx-lm module (a stage of one: its PipelineMixin sends and receives)
            steps = {"prefill": adapter.prefill, "chunk": adapter.prefill_chunk, "decode": adapter.decode}
            if a.can_verify:
                steps["verify"] = adapter.verify
            bound = {phase: partial(fn, args=a) for phase, fn in steps.items()}
        elif model.stage is None:
            arch = architecture(a.model_type)
            steps = {"prefill": arch.prefill, "chunk": arch.prefill_chunk, "decode": arch.decode}
            if hasattr(arch, "verify"):
                steps["verify"] = arch.verify
            bound = {phase: partial(fn, args=a) for phase, fn in steps.items()}
        else:
            steps = {"prefill": pipeline.prefill, "chunk": pipeline.prefill_chunk, "decode": pipeline.decode}
            bound = {phase: partial(fn, args=a, stage=model.stage, group=model.group) for phase, fn in steps.items()}
        eager = ("prefill", "chunk") if isinstance(a, AdapterArgs) and a.loops_prompts else ()
        if eager:
            log.info("model %s: prefill and chunk steps run eagerly (its gated delta layers loop over positions "
                     "in mlx-lm's ops here)", model.name)  # fmt: skip
        self._specs = {
            **{phase: StepSpec(fn, eager=phase in eager) for phase, fn in bound.items()},
            "sample": StepSpec(sampling.sample, random_state=True),
            "greedy": StepSpec(sampling.greedy, shapeless=True),
            "process": StepSpec(sampling.process),
            "logprobs": StepSpec(sampling.logprobs),
        }
        windows = a.windows  # an mlx-lm stage's layouts are its own layers' already
        if windows is not None and model.stage is not None and not isinstance(a, AdapterArgs):
            windows = windows[model.stage.start : model.stage.stop]
        self.windows: Windows | None = windows if windows and any(w is not None for w in windows) else None
        self.vocab = a.vocab_size
        self.wait_seconds = 0.0  # seconds spent waiting for the device's results (monotonic)
        self.pool: PagedKV | None = None  # the paged KV pool, once :meth:`use_paged` made one
        self.kv_bits: int | None = None  # the pool's quantization (kv_bits), if any
        self.kv_group_size = 64
        self.in_blocks = False  # prefill writes into the pool's blocks (:func:`prefills_in_blocks`)
        self.waits_before_pool_writes = waits_before_pool_writes()  # :meth:`wait_for_pool`

    # -- the paged KV pool -------------------------------------------------------------------

    @property
    def can_page(self) -> bool:
        """Whether this model's decode can read and write a paged KV pool (:func:`pages`)."""
        return pages(self.model)

    @property
    def can_verify(self) -> bool:
        """Whether speculative decoding's verify step runs here: over the static cache (the
        architecture's ``verify``) or, once :meth:`use_paged` ran, over the paged pool (its
        ``verify_paged``)."""
        return "verify" in self._specs

    def use_paged(self, num_blocks: int, block_tokens: int, bits: int | None = None, group_size: int = 64) -> PagedKV:
        """Allocate the paged KV pool (``num_blocks`` blocks of ``block_tokens`` positions per
        layer, block 0 the null block; ``bits``: quantized, :func:`models.paged.quantized_pool`)
        and make ``decode`` run over it (:func:`models.llama.decode_paged`; a pipeline stage's
        pool holds its layers, :func:`models.pipeline.decode_paged`), and ``verify`` too
        where the model has a paged one (:func:`pool_verifies`: :func:`models.llama.verify_paged`,
        :func:`models.adapter.verify_paged`; a stage has none; else none runs: :attr:`can_verify`).
        Returns the pool.

        Raises:
            ValueError: the model cannot page (:attr:`can_page`), or ``bits`` with a head dim that
                is not a multiple of ``group_size``, or with an mlx-lm class that cannot attend
                over quantized keys (:func:`adapter_kv_bits_error`).
        """
        if not self.can_page:
            raise ValueError(f"model type {self.model.args.model_type!r} has no paged decode here")
        a = self.model.args
        if bits and isinstance(a, AdapterArgs):
            if (error := adapter_kv_bits_error(self.model, bits, group_size)) is not None:
                raise ValueError(f"kv_bits = {bits}: {error}; remove kv_bits for it")
        if self.model.stage is not None and not isinstance(a, AdapterArgs):  # this rank's layers, over the group
            stage, group = self.model.stage, self.model.group
            step = partial(pipeline.decode_paged, args=a, stage=stage, group=group, bits=bits, group_size=group_size)
            if bits:  # staged prompts attend as one process's quantized blocks (models.pipeline.prefill)
                for phase, fn in (("prefill", pipeline.prefill), ("chunk", pipeline.prefill_chunk)):
                    staged = partial(fn, args=a, stage=stage, group=group, bits=bits, group_size=group_size)
                    self._specs[phase] = StepSpec(staged)
        else:
            arch = adapter if isinstance(a, AdapterArgs) else architecture(a.model_type)
            step = partial(arch.decode_paged, args=a, bits=bits, group_size=group_size)
        self._specs["decode"] = StepSpec(step)
        self._specs.pop("verify", None)  # a static cache's verify step cannot run over the pool
        if pool_verifies(self.model):  # one process only
            arch = adapter if isinstance(a, AdapterArgs) else architecture(a.model_type)
            self._specs["verify"] = StepSpec(partial(arch.verify_paged, args=a, bits=bits, group_size=group_size))
        self.in_blocks = prefills_in_blocks(self.model, bits)
        if self.in_blocks:  # the same compile keys (phase, B, T[, C]) as the staging steps they replace
            step = partial(architecture(a.model_type).prefill_paged, args=a, bits=bits, group_size=group_size)
            self._specs["prefill"] = self._specs["chunk"] = StepSpec(step)
        self.kv_bits, self.kv_group_size = bits, group_size
        self.pool = PagedKV.allocate(
            len(a.kv_layouts) if isinstance(a, AdapterArgs) else self.model.layers,
            num_blocks,
            a.num_key_value_heads,
            block_tokens,
            a.dim_per_head,
            self.model.dtype,
            bits,
            group_size,
        )
        mx.eval(self.pool)  # built now, on this thread: a lazy zeros would be evaluated on the engine's
        return self.pool

    def wait_for_pool(self) -> None:
        """Before a step built on the paged pool (a decode, verify or prefill step; copy-on-writes
        before it) is queued: wait for the device's work in flight (``mx.synchronize``), where
        :attr:`waits_before_pool_writes` (a GPU, :func:`waits_before_pool_writes`).

        Why: MLX writes a scatter's input buffer in place only when nothing else holds it
        (``array::is_donatable``), and a queued GPU step holds every input of its kernels
        until it completes (MLX's CUDA back-end: ``CommandEncoder::add_temporary``; Metal's: the
        buffers its command buffer's completion handler keeps). The step before holds the pool
        (its attention reads the layers it wrote), so a step queued while it runs would copy
        layers of the whole pool first: a pool sized to the memory budget copied per step, and
        held twice (the static cache copies its rows only). The host has built this step (the
        Python side) while the previous one ran; only the queueing, by the caller's
        ``mx.async_eval``, comes after the wait. Benchmarks set the attribute False to measure
        what it saves."""
        if self.waits_before_pool_writes:
            mx.synchronize()

    # -- compiled functions and buffers of this process -------------------------------------

    def step_fn(self, phase: str, batch: int = 0, size: int = 0, capacity: int = 0) -> Callable:
        """The compiled function of ``phase`` at bucket (batch, size[, capacity]); counts a hit
        or miss. A model phase called this way runs on this process only: use the operations
        below for anything a group's other ranks must run too."""
        key = StepKey(self.model.name, phase, batch, size, self._dtype_name, capacity)
        return self.compiled.get(key, self._specs[phase])

    def register(self, phase: str, spec: StepSpec) -> None:
        """Add a step function (``phase``) that :meth:`step_fn` compiles per bucket (this
        process only: a speculative verify step or a draft model's steps)."""
        self._specs[phase] = spec

    def new_kv(self, batch: int, capacity: int, ring: bool = False) -> KVCache:
        """A zeroed KV cache [batch, Hkv, capacity, D] per layer of this process, in the compute
        dtype, on this process only (for dummy inputs; :meth:`alloc` is the operation). With
        ``ring`` (a decode cache) a sliding-window layer holds min(window, capacity) positions.
        An mlx-lm module's cache has its own layouts and recurrent states
        (:meth:`models.adapter.AdapterArgs.allocate`)."""
        a = self.model.args
        if isinstance(a, AdapterArgs):
            return a.allocate(batch, capacity, self.model.dtype, ring)
        return KVCache.allocate(
            self.model.layers,
            batch,
            a.num_key_value_heads,
            capacity,
            a.dim_per_head,
            self.model.dtype,
            self.windows if ring else None,
        )

    # -- operations --------------------------------------------------------------------------

    def alloc(self, batch: int, capacity: int, ring: bool = False) -> KVCache:
        """A zeroed KV cache [batch, Hkv, capacity, D] per layer: a decode cache (``ring``:
        sliding-window layers as rings) or a linear staging cache."""
        return self.new_kv(batch, capacity, ring)

    def prefill(
        self, tokens: list[list[int]], lengths: list[int], bucket: tuple[int, int] | None = None
    ) -> tuple[mx.array, KVCache]:
        """Prefill B prompts right-padded to T tokens (``tokens``: B lists of T ids; ``lengths``:
        B real lengths >= 1) on a new cache of capacity T. Returns (float32 logits [B, V] at
        each row's last real token, lazy; the cache [B, Hkv, T, D] per layer).

        ``bucket``: the (batch, prompt) bucket the call is looked up and counted under, where
        the prefill step runs eagerly (:attr:`exact_prefill`) and (B, T) is smaller than it;
        default (B, T)."""
        B, T = len(tokens), len(tokens[0])
        fn = self.step_fn("prefill", *(bucket or (B, T)))
        return fn(self.model.params, mx.array(tokens, mx.int32), mx.array(lengths, mx.int32), self.new_kv(B, T))

    @property
    def exact_prefill(self) -> bool:
        """Whether prompts may be prefilled at their own shape rather than padded to a bucket:
        whole prompts as B rows of the longest prompt's T tokens (:meth:`prefill`), a chunk
        as its real tokens (:meth:`chunk`, :meth:`chunk_rows`). The prefill and chunk steps
        run eagerly (:attr:`StepSpec.eager`: nothing is compiled per shape), so padding would
        only add work (a model whose gated delta layers loop over positions pays for every
        padded one). One process only: a pipeline group's ranks, whose stages may compile
        their prefill, run each call at its bucket."""
        return self._specs["prefill"].eager and self._specs["chunk"].eager and self.model.stage is None

    def chunk(self, kv: KVCache, tokens: list[int], offset: int, length: int) -> tuple[mx.array, KVCache]:
        """Prefill one chunk of one prompt: ``tokens`` (T ids, right-padded; ``length`` real)
        at positions ``offset``.. of the batch-1 staging cache ``kv`` [1, Hkv, C, D] (offset + T
        <= C). Returns (float32 logits [1, V] at the chunk's last real token, lazy; the cache).
        Where the chunk step runs eagerly (:attr:`exact_prefill`) only the ``length`` real
        tokens run, the call looked up and counted at its bucket T."""
        fn = self.step_fn("chunk", 1, len(tokens), kv.capacity)
        if self.exact_prefill:
            tokens = tokens[:length]
        ids, at, n = mx.array([tokens], mx.int32), mx.array([offset], mx.int32), mx.array([length], mx.int32)
        return fn(self.model.params, ids, at, n, kv)

    def chunk_rows(
        self, kvs: list[KVCache], tokens: list[list[int]], offsets: list[int], lengths: list[int], batch: int
    ) -> tuple[mx.array, KVCache]:
        """Prefill one chunk of each of n prompts in one call (the final chunks of prefix-cache
        hits, or of long prompts, that share a chunk bucket T and a staging capacity C).

        ``kvs`` are the n batch-1 staging caches [1, Hkv, C, D] per layer; row i's ``tokens[i]``
        (T ids, right-padded; ``lengths[i]`` real) go at positions ``offsets[i]``.. of its row
        (offsets[i] + T <= C). The rows are copied into one cache of ``batch`` rows (a batch
        bucket >= n; rows n.. repeat row 0 and prefill a dummy token at offset 0), one
        concatenation per layer for keys and values, and ``chunk`` runs at (batch, T, C): one
        compiled call instead of n (on a GPU each call is hundreds of kernel launches).
        Recurrent states [1, ...] are stacked the same way (a padding row's state is row 0's:
        its output is never read).

        Returns (float32 logits [batch, V] at each row's last real token, lazy; the batched
        cache [batch, Hkv, C, D] per layer, row i holding prompt i). Where the chunk step runs
        eagerly (:attr:`exact_prefill`) only the n rows run, each right-padded to the longest
        real length, not T: the cache has n rows and the logits' rows n.. repeat row 0; the
        call is looked up and counted at (batch, T, C). Raises ValueError when the caches'
        capacities differ or n > batch, RuntimeError where this executor runs chunks one by
        one (a group's leader: its operations are broadcast one chunk at a time).
        """
        if not self.batches_chunks:
            raise RuntimeError("this executor runs prompts' chunks one by one (batches_chunks is off)")
        n = len(kvs)
        if not 0 < n <= batch or len({kv.capacity for kv in kvs}) != 1:
            raise ValueError(f"{n} staging caches of capacities {[kv.capacity for kv in kvs]} for {batch} rows")
        T = len(tokens[0])
        fn = self.step_fn("chunk", batch, T, kvs[0].capacity)
        run = batch  # the rows the call runs: n at the prompts' own shape
        if self.exact_prefill:
            run, T = n, max(lengths)
            tokens = [row[:T] for row in tokens]
        rows = kvs + [kvs[0]] * (run - n)

        def stack(parts) -> list[mx.array]:
            return [mx.concatenate(list(layer), axis=0) for layer in zip(*parts, strict=True)]

        stacked = KVCache(
            stack(kv.keys for kv in rows), stack(kv.values for kv in rows), stack(kv.states for kv in rows)
        )
        ids = mx.array(tokens + [[0] * T] * (run - n), mx.int32)
        at = mx.array(offsets + [0] * (run - n), mx.int32)
        real = mx.array(lengths + [1] * (run - n), mx.int32)
        logits, kv = fn(self.model.params, ids, at, real, stacked)
        return rows_at_bucket(logits, batch), kv

    def prefill_blocks(
        self,
        tables: list[list[int]],
        tokens: list[list[int]],
        offsets: list[int],
        lengths: list[int],
        batch: int,
        capacity: int = 0,
    ) -> mx.array:
        """Prefill one chunk of each of n prompts straight into the paged pool's blocks
        (:func:`models.llama.prefill_paged`; :attr:`in_blocks`), replacing the pool.

        Row i's ``tokens[i]`` (T ids, right-padded; ``lengths[i]`` real) go at positions
        ``offsets[i]``.. of its blocks ``tables[i]`` (in position order), which it must hold
        unshared from its offset on (its prefix hit's blocks come before). ``capacity`` 0: a
        whole prompt (offset 0), compiled as ``prefill`` at (batch, T) over a view of T positions
        rounded up to blocks; else a chunk, compiled as ``chunk`` at (batch, T, capacity) over a
        view of ``capacity`` positions (a multiple of the block size, at least each row's real
        end). Rows n..batch-1 are padding (a dummy token at offset 0, a table of null blocks).

        Returns:
            float32 logits [batch, V] at each row's last real token (lazy).

        Raises:
            ValueError: more rows than ``batch``, or a row's real tokens past the view.
        """
        pool = self.pool
        assert pool is not None and self.in_blocks, "use_paged() with a model that prefills in blocks first"
        n, T, bt = len(tokens), len(tokens[0]), pool.block_tokens
        width = -(-(capacity or T) // bt)
        ends = [o + k for o, k in zip(offsets, lengths, strict=True)]
        if not 0 < n <= batch or max(ends) > width * bt:
            raise ValueError(f"{n} rows ending at {ends} for {batch} rows of {width * bt} positions")
        rows = [(t[:width] + [NULL_BLOCK] * width)[:width] for t in tables] + [[NULL_BLOCK] * width] * (batch - n)
        fn = self.step_fn("chunk", batch, T, capacity) if capacity else self.step_fn("prefill", batch, T)
        # The pool is evaluated before the call is built on it. Built on a pool still pending
        # from an earlier step, a batched last-chunk call gave one row wrong tokens now and then
        # on a loaded CPU (tests/unit/test_paged_prefill_engine.py run after test_paged_kv.py and
        # test_paged_prefill.py); never with this evaluation, with Python's garbage collector
        # off, with a gc.collect() at the test's start, or with the earlier tests' compiled
        # functions kept alive: the trigger is the collector destroying mx.compile callables
        # while this step is built or run. How that reaches this call's result is not known.
        mx.eval(pool)
        logits, self.pool = fn(
            self.model.params,
            mx.array(tokens + [[0] * T] * (batch - n), mx.int32),
            mx.array(offsets + [0] * (batch - n), mx.int32),
            mx.array(lengths + [1] * (batch - n), mx.int32),
            mx.array(rows, mx.int32),
            pool,
        )
        self.wait_for_pool()
        return logits

    def decode(self, kv: DecodeCache, tokens: mx.array, positions: list[int]) -> tuple[mx.array, DecodeCache]:
        """One decode step of every row of ``kv`` [B, Hkv, C, D]: ``tokens`` int32 [B] (possibly
        still lazy: the previous step's output), written at ``positions`` (B ints < C).
        Returns (float32 logits [B, V], lazy; the cache).

        ``kv`` may be the rows' block tables (:class:`PagedTables`, int32 [B, C / bt]) instead:
        the step then reads and writes the paged pool (:meth:`use_paged`), which it replaces."""
        return self._run(self.step_fn("decode", kv.batch, kv.capacity), kv, tokens, positions)

    def verify(self, kv: DecodeCache, tokens: mx.array, positions: list[int]) -> tuple[mx.array, DecodeCache]:
        """One verify step (speculative decoding) of every row of ``kv``: ``tokens`` int32 [B, W]
        (each row's newest token, then its proposals, padded), row b's written at positions
        ``positions[b]``..``positions[b] + W - 1`` (each below C). Returns (float32 logits
        [B, W, V], lazy; the cache). ``kv`` may be the rows' block tables (:class:`PagedTables`):
        the step then reads and writes the paged pool, which it replaces; every block a row's
        W positions fall in must be the row's own or the null block (:meth:`PagedDecodeBatch.reserve`).

        Raises:
            KeyError: no verify step runs here (:attr:`can_verify`)."""
        return self._run(self.step_fn("verify", kv.batch, tokens.shape[1], kv.capacity), kv, tokens, positions)

    def _run(
        self, fn: Callable, kv: DecodeCache, tokens: mx.array, positions: list[int]
    ) -> tuple[mx.array, DecodeCache]:
        """Call a decode or verify step ``fn`` over ``kv``: a static cache is passed and returned
        by the step; with block tables the step reads and writes the paged pool, kept here."""
        at = mx.array(positions, mx.int32)
        if isinstance(kv, PagedTables):
            assert self.pool is not None, "use_paged() first"
            logits, self.pool = fn(self.model.params, tokens, at, kv.table, self.pool)
            self.wait_for_pool()
            return logits, kv
        return fn(self.model.params, tokens, at, kv)

    def dummy_cache(self, batch: int, capacity: int) -> KVCache | PagedTables:
        """What a dummy decode or verify step at (``batch``, ``capacity``) runs over (warm-up and
        speculation's calibration): a zeroed linear cache, or with the paged pool every row's
        table of null blocks (their writes land in the null block; the pool is the real one)."""
        if self.pool is not None:
            return PagedTables(mx.zeros((batch, capacity // self.pool.block_tokens), mx.int32), batch, capacity)
        return self.new_kv(batch, capacity)

    def write_blocks(self, source: KVCache, row: int, blocks: list[int], length: int, start: int = 0) -> None:
        """Copy positions start..length-1 of row ``row`` of a linear (prefill or staging) cache
        [B', Hkv, C', D] into the paged pool's ``blocks`` (position p to offset p % bt of block
        ``blocks[(p - start) // bt]``), one indexed copy per layer for keys and values. ``start``
        (a multiple of bt): the positions before it are in blocks the row already holds (a
        prefix hit's, which are shared and not written again). Positions past ``length`` in the
        last block get whatever the source holds there (or zeros), which attention masks by
        position."""
        pool = self.pool
        assert pool is not None, "use_paged() first"
        bt, n, dtype = pool.block_tokens, len(blocks), self.model.dtype
        if n == 0:
            return
        index = mx.array(blocks, mx.int32)

        def shaped(buf: mx.array) -> mx.array:  # [Hkv, C', D] -> [n, Hkv, bt, D]
            part = buf[row, :, start : start + n * bt]
            if part.shape[1] < n * bt:
                part = mx.pad(part, [(0, 0), (0, n * bt - part.shape[1]), (0, 0)])
            H, _, D = part.shape
            return part.reshape(H, n, bt, D).transpose(1, 0, 2, 3).astype(dtype)

        def put(pools: list, layer: int, new: mx.array) -> None:
            if pool.quantized:  # each part of the triple, quantized as a step writes it
                parts = mx.quantize(new, group_size=self.kv_group_size, bits=self.kv_bits)
                for part, value in zip(pools[layer], parts, strict=True):
                    part[index] = value
            else:
                pools[layer][index] = new

        for layer, (keys, values) in enumerate(zip(source.keys, source.values, strict=True)):
            put(pool.keys, layer, shaped(keys))
            put(pool.values, layer, shaped(values))

    def read_blocks(self, blocks: list[int], capacity: int) -> KVCache:
        """A batch-1 linear (staging) cache [1, Hkv, capacity, D] per layer, in the compute
        dtype, whose positions 0..len(blocks) * bt - 1 are the paged pool's ``blocks`` in order
        (a prefix hit's; dequantized from a ``kv_bits`` pool) and the rest zeros, as a
        :meth:`alloc` cache after those positions were prefilled (lazy: one gather per layer for
        keys and values). Raises ValueError when the blocks hold more than ``capacity`` positions."""
        pool = self.pool
        assert pool is not None, "use_paged() first"
        positions = len(blocks) * pool.block_tokens
        if positions > capacity:
            raise ValueError(f"{len(blocks)} blocks hold {positions} positions, over the capacity {capacity}")
        table, dtype, at = mx.array([blocks], mx.int32), self.model.dtype, mx.array([0, 0, 0, 0], mx.int32)

        def view(layer_pool) -> mx.array:  # the layer's blocks as [1, Hkv, capacity, D]
            if pool.quantized:
                index = view_index(table, layer_pool[0].shape[1], pool.block_tokens)
                part = mx.dequantize(
                    *gather_quantized(layer_pool, index), group_size=self.kv_group_size, bits=self.kv_bits
                )
            else:
                part = gather(layer_pool, table)
            zeros = mx.zeros((1, part.shape[1], capacity, part.shape[3]), dtype)
            return mx.slice_update(zeros, part.astype(dtype), at, (0, 1, 2, 3))

        return KVCache([view(k) for k in pool.keys], [view(v) for v in pool.values])

    def copy_pool_blocks(self, copies: list[BlockCopy]) -> None:
        """The block pool's copy-on-writes (:meth:`BlockPool.append_slots`): every layer's keys
        and values of each ``src`` block copied into its ``dst`` block of the paged pool, in
        place (one indexed copy per layer and array; ``dst`` distinct and no ``dst`` a ``src``)."""
        pool = self.pool
        assert pool is not None, "use_paged() first"
        if not copies:
            return
        src = mx.array([c.src for c in copies], mx.int32)
        dst = mx.array([c.dst for c in copies], mx.int32)
        for pools in (pool.keys, pool.values):
            for layer_pool in pools:
                parts = layer_pool if isinstance(layer_pool, tuple) else (layer_pool,)
                for part in parts:  # an array's item assignment replaces it in its list or triple
                    part[dst] = part[src]

    def resize(self, kv: KVCache, capacity: int, ring: bool = True) -> KVCache:
        """``kv`` at another capacity (one copy): a decode cache (``ring``: its rings stay rings,
        see :meth:`models.kv_cache.KVCache.resized`), or a linear staging cache (``ring`` False:
        every layer grows to ``capacity``, as a chunk writes each position at its own index)."""
        return kv.resized(capacity, self.windows if ring else None)

    def reorder(self, kv: KVCache, rows: list[int]) -> KVCache:
        """A cache whose row i is row ``rows[i]`` of ``kv`` (:meth:`KVCache.reordered`)."""
        return kv.reordered(rows)

    def resize_batch(self, kv: KVCache, batch: int) -> KVCache:
        """``kv`` padded (with empty rows) or cut to ``batch`` rows (:meth:`KVCache.batch_resized`)."""
        return kv.batch_resized(batch)

    def insert_rows(self, kv: KVCache, source: KVCache, slots: list[int], rows: list[int], lengths: list[int]) -> None:
        """Copy rows ``rows`` of a linear (prefill or staging) cache ``source`` [B', Hkv, C',
        D], row i holding positions 0..lengths[i]-1, into rows ``slots`` of the decode cache
        ``kv``, in place (:meth:`models.kv_cache.KVCache.insert_rows`: one indexed copy per layer
        for the rows that fit linearly; a wrapped ring gets each row's latest positions)."""
        kv.insert_rows(slots, source, rows, lengths)

    def save_blocks(self, kv: KVCache, rows: list[int], starts: list[int], block_tokens: int) -> list[mx.array]:
        """The prefix cache's new blocks: for each row r of ``rows``, then each start s,
        positions [s, s + block_tokens) of row r of ``kv``, as [layers, 2, Hkv, block_tokens,
        D] (see :func:`service.engine.kv_blocks.copy_blocks`); their evaluation is queued."""
        blocks = copy_blocks(kv, rows, starts, block_tokens)
        mx.async_eval(blocks)
        return blocks

    def gather_blocks(self, blocks: list[mx.array], capacity: int) -> KVCache:
        """A batch-1 cache of ``capacity`` positions starting with ``blocks`` (prefix-cache
        blocks, in prompt order; :func:`service.engine.kv_blocks.join_blocks`)."""
        return join_blocks(blocks, capacity)

    def dummy_inputs(self, phase: str, batch: int, size: int, capacity: int = 0) -> tuple:
        """Arguments of ``phase``'s step function at bucket (batch, size[, capacity]): zero tokens,
        positions and offsets, lengths of 1, a zeroed KV cache (of this process's layers), zero
        logits and keys, no seeded rows (vLLM's ``_dummy_run``, nano-vllm's ``warmup_model``)."""
        params, vocab = self.model.params, self.vocab
        if phase in ("prefill", "chunk") and self.in_blocks:  # null tables over the real pool (no second one)
            assert self.pool is not None
            zeros, ones = mx.zeros((batch,), mx.int32), mx.ones((batch,), mx.int32)
            table = mx.zeros((batch, -(-(capacity or size) // self.pool.block_tokens)), mx.int32)
            return params, mx.zeros((batch, size), mx.int32), zeros, ones, table, self.pool
        if phase == "chunk":
            zeros, ones = mx.zeros((batch,), mx.int32), mx.ones((batch,), mx.int32)
            return params, mx.zeros((batch, size), mx.int32), zeros, ones, self.new_kv(batch, capacity)
        if phase == "prefill":
            return params, mx.zeros((batch, size), mx.int32), mx.ones((batch,), mx.int32), self.new_kv(batch, size)
        if phase == "decode":
            zeros = mx.zeros((batch,), mx.int32)
            if self.pool is not None:  # every row's table of null blocks; the real pool (no second one)
                table = mx.zeros((batch, size // self.pool.block_tokens), mx.int32)
                return params, zeros, zeros, table, self.pool
            return params, zeros, zeros, self.new_kv(batch, size, ring=True)
        if phase == "verify":  # size: the width W; a linear cache (a verify step writes W per row)
            tokens, zeros = mx.zeros((batch, size), mx.int32), mx.zeros((batch,), mx.int32)
            if self.pool is not None:
                table = mx.zeros((batch, capacity // self.pool.block_tokens), mx.int32)
                return params, tokens, zeros, table, self.pool
            return params, tokens, zeros, self.new_kv(batch, capacity)
        if phase == "greedy":
            return (mx.zeros((1, vocab), mx.float32),)
        ones, logits = mx.ones((batch,), mx.float32), mx.zeros((batch, vocab), mx.float32)
        if phase == "process":
            allowed = mx.full((batch, (vocab + 31) // 32), -1, mx.int32)
            return logits, logits, allowed, ones, mx.zeros((batch, vocab), mx.bool_)
        if phase == "logprobs":
            return logits, mx.zeros((batch,), mx.int32)
        keys, no_min_p = mx.zeros((batch, 2), mx.uint32), mx.zeros((batch,), mx.float32)
        return logits, ones, ones, mx.full((batch,), vocab, mx.int32), no_min_p, keys, mx.zeros((batch,), mx.bool_)

    def warm(self, phase: str, batch: int, size: int, capacity: int = 0, repeats: int = 3) -> bool:
        """Compile and run one bucket's step on dummy inputs (:meth:`dummy_inputs`).
        Under the ``auto`` policy, time it compiled and eager (``repeats`` runs each) and keep
        the faster. Returns whether the bucket runs compiled."""
        fn = self.step_fn(phase, batch, size, capacity)
        pooled = self.pool is not None and (
            phase in ("decode", "verify") or (phase in ("prefill", "chunk") and self.in_blocks)
        )
        auto = self.compiled.policy == "auto"
        if auto and not pooled:
            return fn.calibrate(self.dummy_inputs(phase, batch, size, capacity), repeats)
        args = list(self.dummy_inputs(phase, batch, size, capacity))
        if pooled:  # the call alone holds the pool, so its first evaluation writes it in place
            self.pool = None
            if auto:  # every timed call hands the pool on, never copies it
                held = [args.pop()]
                compiled = fn.calibrate_pooled(tuple(args), held, repeats)
                self.pool = held.pop()
                return compiled
        out = fn.call_owning(args)  # empties args
        if pooled:
            self.pool = out[1]  # the pool is replaced, not copied: the old one is no longer held
        mx.eval(out)
        return fn.compiled

    # -- waiting, and the group's life (nothing to do in one process) ----------------------

    def wait(self, *arrays) -> None:
        """``mx.eval`` the arrays, counting the wait in ``wait_seconds``."""
        start = time.perf_counter()
        mx.eval(*arrays)
        self.wait_seconds += time.perf_counter() - start

    def read(self, tokens: mx.array) -> list[int]:
        """Read int32 [B] tokens back to the host (waiting: counted in ``wait_seconds``)."""
        start = time.perf_counter()
        out = [int(t) for t in tokens.tolist()]  # type: ignore[union-attr]  # tolist of a 1-D array is a list
        self.wait_seconds += time.perf_counter() - start
        return out

    def seal(self) -> None:
        """Warm-up is over: a compile-cache miss now runs eagerly (:meth:`CompileCache.seal`)."""
        self.compiled.seal()

    def idle(self) -> None:
        """The engine has nothing to do for a moment (a group's rank 0 tells the others)."""

    def close(self) -> None:
        """The engine stops serving (a group's rank 0 tells the others to exit)."""

    def stalled_s(self) -> float:
        """Seconds the engine has been waiting on another process (0: none; one process never)."""
        return 0.0

    def raise_if_fatal(self, exc: Exception) -> None:
        """Called with what an engine step raised before its requests are failed: in one process
        the engine goes on; a pipeline group's rank 0 raises ``GroupLost`` instead, since its
        ranks may no longer be in step (and a collective after a failed one would hang)."""
