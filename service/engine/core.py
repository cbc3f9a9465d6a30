"""The engine: one thread that owns MLX and loops schedule -> execute -> apply.

Handlers never touch MLX: they :meth:`Engine.submit` a :class:`Sequence` and await the
events it emits. Each iteration the scheduler plans (admissions, aborts), the engine starts
new requests from the prefix cache's blocks, the prefiller runs the admitted prompts, the
decode batch takes the prefilled requests, the speculator's verify step or the runner's
pipelined plain step decodes it, the prompts' blocks go into the prefix cache, and the engine
applies the tokens each part returns, finishing requests in exactly one place,
:meth:`Engine._finish`.

Only the engine composes: it holds the executor, the token selector, the decode batch, the
runner, the prefiller, the speculator, the prefix cache and the scheduler side by side and
hands each the shared pieces it needs; none of them holds or calls another.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import cached_property, partial

import mlx.core as mx

from models.loader import LoadedModel
from service.engine.batch import DecodeBatch
from service.engine.block_pool import BlockPool, NoFreeBlocks
from service.engine.buckets import BucketTable
from service.engine.compile_cache import CompileCache
from service.engine.draft import DraftProposer
from service.engine.grammar import GrammarError, TokenGrammar
from service.engine.group import GroupLost, executor_for
from service.engine.lookup import PromptLookup
from service.engine.outputs import RunnerOutput
from service.engine.paged_batch import PagedDecodeBatch
from service.engine.prefill import Prefiller
from service.engine.prefix_cache import PrefixCache
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler
from service.engine.selector import TokenSelector
from service.engine.sequence import FinishReason, Sequence
from service.engine.speculative import Speculator
from service.engine.threads import on_own_thread
from service.metrics import Metrics, PrefixCacheStat, RequestStat

log = logging.getLogger("stepserve.engine")

IDLE_WAIT_S = 0.05
SHUTDOWN = "server shutting down"


class Engine:
    """Serves one model with continuous batching over compiled buckets.

    Args:
        model: the loaded model.
        buckets: bucket table; its largest batch bucket caps the running batch.
        cache: the compile cache.
        metrics: where stats go.
        max_waiting: queued requests beyond the running batch (more get 429).
        max_running: running sequences at most (default and ceiling: the largest batch bucket).
        chunk_tokens: prompt tokens one request prefills per step at most (chunked prefill).
        max_batched_tokens: tokens one step processes at most (decode rows plus prompt chunks).
        prefix: the prefix cache (None: none). With a paged pool (``kv_pool_tokens``) the pool's
            blocks are the prefix cache (a hit references them): ``prefix`` then only says
            whether prefix reuse is on (a budget of 0: off) and stores nothing.
        proposer: speculative decoding's proposer (None: no speculation).
        speculative_tokens: K, proposals per row at most.
        speculative_max_batch: speculate in batch buckets up to this one without measuring
            (None: the warm-up's calibration decides, :mod:`service.engine.spec_warmup`).
    """

    def __init__(
        self,
        model: LoadedModel,
        buckets: BucketTable,
        cache: CompileCache,
        metrics: Metrics,
        max_waiting: int = 256,
        max_running: int | None = None,
        chunk_tokens: int = 512,
        max_batched_tokens: int = 2048,
        prefix: PrefixCache | None = None,
        proposer: PromptLookup | DraftProposer | None = None,
        speculative_tokens: int = 4,
        speculative_max_batch: int | None = None,
        kv_pool_tokens: int | None = None,
        kv_block_tokens: int = 16,
        kv_bits: int | None = None,
    ):
        self.model, self.buckets, self.metrics = model, buckets, metrics
        chunk_tokens = buckets.chunk_tokens(chunk_tokens)
        self.executor = executor_for(model, cache)
        self.selector = TokenSelector(model.args.vocab_size, self.executor.step_fn)
        self.prefix = prefix if prefix is not None else PrefixCache(block_tokens=buckets.prompt[0], budget_bytes=0)
        self.batch = DecodeBatch(buckets, self.executor)
        if kv_pool_tokens is not None:
            caching = self.prefix.budget_bytes > 0
            self.prefix = PrefixCache(self.prefix.block_tokens, budget_bytes=0)  # the pool's blocks are the cache
            self.batch = self._paged_batch(kv_pool_tokens, kv_block_tokens, proposer is not None, kv_bits, caching)
        elif kv_bits is not None:
            raise ValueError("kv_bits quantizes the paged pool's blocks: set kv_cache = 'paged' too")
        self.prefix.ops = self.executor  # a group's ranks each keep their own layers' blocks
        self.runner = ModelRunner(self.executor, self.selector, self.batch)
        whole_tokens = max(max_batched_tokens, chunk_tokens)
        self.prefiller = Prefiller(self.executor, self.selector, buckets, chunk_tokens, whole_tokens)
        if self.paged is not None and self.executor.in_blocks:  # prompts prefill straight into their blocks
            self.prefiller.blocks = self.paged.blocks
        self.speculator: Speculator | None = None
        if proposer is not None:
            self.speculator = Speculator(
                proposer, self.executor, self.selector, buckets, speculative_tokens, speculative_max_batch
            )
        running = min(max_running or buckets.batch[-1], buckets.batch[-1])
        peek = self.paged.blocks.peek if self.paged is not None else self.prefix.peek
        self.scheduler = Scheduler(running, max_waiting, chunk_tokens, max_batched_tokens, peek, self._fits)
        self.capacity_limit = buckets.capacity[-1]
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()
        self.not_ready_reason = "warming up"
        self.warmup_seconds: float | None = None
        self.warmup_buckets = 0
        self._prefix_evict = 0  # bytes of prefix-cache blocks admission asked to free
        self.rehearsed: list[str] = []  # what the warm-up rehearsal ran (service.process.warmer)
        self.failure: str | None = None  # why the engine thread ended, when it had to (a lost pipeline group)
        metrics.init_model(model.name)
        metrics.running.labels(model.name).set_function(lambda: self.scheduler.num_running)
        metrics.waiting.labels(model.name).set_function(lambda: self.scheduler.num_waiting)
        if (paged := self.paged) is not None:
            for state in ("used", "cached", "free", "total"):
                metrics.kv_blocks.labels(model.name, state).set_function(
                    lambda state=state: getattr(paged.blocks.stats(), state)
                )

    def _paged_batch(
        self, pool_tokens: int, block_tokens: int, speculative: bool, bits: int | None = None, caching: bool = True
    ) -> PagedDecodeBatch:
        """The decode batch over a paged pool of ``pool_tokens`` positions (rounded up to whole
        blocks, plus the null block), its blocks published for prefix hits when ``caching``;
        ``speculative``: verify steps run over the pool too (:meth:`PagedDecodeBatch.reserve`).

        Raises:
            ValueError: the model cannot page, a capacity bucket is not a multiple of
                ``block_tokens``, or ``speculative`` where the model type has no paged verify step.
        """
        if not self.executor.can_page:
            raise ValueError(
                f"kv_cache = 'paged' needs a hand-written model family or an mlx-lm class whose "
                f"attention caches are all of one shape with no recurrent state; model type "
                f"{self.model.args.model_type!r} here is neither (set kv_cache = 'static')"
            )
        if any(c % block_tokens for c in self.buckets.capacity):
            raise ValueError(f"every capacity bucket must be a multiple of kv_block_tokens ({block_tokens})")
        num_blocks = -(-pool_tokens // block_tokens) + 1  # + the null block
        self.executor.use_paged(num_blocks, block_tokens, bits)
        if speculative and not self.executor.can_verify:
            raise ValueError(
                f"kv_cache = 'paged' has no speculative verify step for model type "
                f"{self.model.args.model_type!r}; set speculative = 'off' (or kv_cache = 'static')"
            )
        return PagedDecodeBatch(self.buckets, self.executor, BlockPool(num_blocks, block_tokens, caching=caching))

    def kv_summary(self) -> dict:
        """How this engine keeps its KV cache, for ``/readyz``: ``{"cache": "static"}``, or for a
        paged pool its size in tokens and blocks, its ``kv_bits`` (4 or 8: quantized; None: the
        compute dtype), the blocks used now (held by requests), cached and free, and the
        preemptions so far."""
        paged = self.paged
        if paged is None:
            return {"cache": "static"}
        stats, bt = paged.blocks.stats(), paged.blocks.block_tokens
        return {
            "cache": "paged",
            "tokens": stats.total * bt,
            "block_tokens": bt,
            "kv_bits": self.executor.kv_bits,
            "blocks": {"total": stats.total, "used": stats.used, "cached": stats.cached, "free": stats.free},
            "preemptions": paged.preemptions,
        }

    @property
    def paged(self) -> PagedDecodeBatch | None:
        """The decode batch when it is paged (None: the static cache)."""
        return self.batch if isinstance(self.batch, PagedDecodeBatch) else None

    # -- the API for handlers, shutdown, the watchdog and admission (thread-safe) ----------

    def start(self, prepare: Callable[[Engine], None] | None = None) -> None:
        """Start the engine thread; it runs ``prepare(self)`` first (the warm-up,
        :func:`service.process.warmer.warm_up`: it may :meth:`step` the engine), then sets
        :attr:`ready` and serves. An exception from ``prepare`` leaves the engine not ready,
        with the reason in :attr:`not_ready_reason`."""
        self._thread = threading.Thread(
            target=self._main, args=(prepare,), name=f"stepserve-engine-{self.model.name}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step; whatever still runs or waits ends as cancelled."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, seq: Sequence) -> None:
        """Queue a request. Raises QueueFullError or DrainingError."""
        self.scheduler.add(seq)

    def cancel(self, seq: Sequence, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """End a request before the next decode step: CANCELLED (the client went away) or
        TIMEOUT (its deadline passed). Its slot is free for the next step."""
        self.scheduler.cancel(seq, reason)

    def drain(self) -> None:
        """Refuse new requests (DrainingError); running and queued ones go on."""
        self.scheduler.drain()

    def abort_all(self) -> None:
        """End every running and queued request as cancelled ("server shutting down") at the
        next step (used when the shutdown grace period is over)."""
        self._abort.set()
        self.scheduler.drain()

    def fail(self, message: str, reason: str = "engine thread died") -> None:
        """The engine thread is gone (or hung in a pipeline group's wait): mark the model not
        ready (``reason``), refuse new work and end every request it held with ``message``
        (HTTP 500). Called by the watchdog, never while the engine thread runs."""
        self.not_ready_reason = reason
        self.ready.clear()
        self.scheduler.drain()
        for seq in self.scheduler.abort_all(FinishReason.ERROR):
            self._finish(seq, FinishReason.ERROR, message)
        self._drop_batch()

    @property
    def prefix_cache_bytes(self) -> int:
        """Bytes the prefix cache holds now beyond the KV cache (read without a lock: an
        estimate); 0 with a paged pool, whose cached blocks are part of the pool."""
        return self.prefix.nbytes

    def shrink_prefix_cache(self, nbytes: int) -> None:
        """Have the engine thread evict at least ``nbytes`` of prefix-cache blocks before its
        next prefill (memory admission calls this rather than refuse a request; a paged pool's
        cached blocks free no memory, and are taken as requests need them anyway)."""
        self._prefix_evict = max(self._prefix_evict, nbytes)

    def load(self) -> list[tuple[int, int]]:
        """(prompt tokens, max_tokens) of every request running or waiting now."""
        return self.scheduler.load()

    def compile_choices(self) -> dict[str, str]:
        """``{"decode b1x256": "compiled" | "eager", ...}`` for every step function built so far."""
        choices = self.executor.compiled.choices().items()
        own = self.model.name  # a draft model's steps are named with its model
        return {
            f"{'' if k.model == own else k.model + ' '}{k.phase} {k.bucket}": "compiled" if c else "eager"
            for k, c in choices
        }

    @property
    def grammars(self) -> TokenGrammar:
        """The grammar compiler for this model's tokenizer (built during warm-up, off the event
        loop: reading the vocabulary into llguidance takes a fraction of a second).

        Raises:
            GrammarError: llguidance cannot read the tokenizer (:class:`TokenGrammar`); the
                model still serves free text.
        """
        built = self._grammars
        if isinstance(built, GrammarError):
            raise GrammarError(str(built))
        return built

    @cached_property
    def _grammars(self) -> TokenGrammar | GrammarError:
        """The grammar compiler, or why there is none (built once either way)."""
        try:
            return TokenGrammar(self.model.tokenizer, self.model.args.vocab_size)
        except GrammarError as exc:
            return exc

    @property
    def compile_policy(self) -> str:
        """The compile policy: "on", "off" or "auto"."""
        return self.executor.compiled.policy

    @property
    def idle(self) -> bool:
        return self.scheduler.num_running == 0 and self.scheduler.num_waiting == 0

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called: the thread ends after its current step."""
        return self._stop.is_set()

    @property
    def alive(self) -> bool:
        """The engine thread is running (False before :meth:`start` and once it ended)."""
        return self._thread is not None and self._thread.is_alive()

    # -- the thread ----------------------------------------------------------------------

    def _main(self, prepare: Callable[[Engine], None] | None) -> None:
        try:
            self._serve(prepare)
        except GroupLost as exc:  # another rank of the pipeline group is gone: nothing can run
            log.critical("%s", exc)
            self.failure = f"{exc}; the group is restarting"

    def _prepare(self, prepare: Callable[[Engine], None]) -> None:
        """Run ``prepare`` (the warm-up, on a thread of its own), then evaluate what the engine
        keeps from one step to the next (the paged pool, the decode cache, a draft's cache)
        there: MLX schedules an array on its creating thread's stream, and one still lazy when
        that thread ends cannot be evaluated by the engine thread ("There is no Stream(cpu, 1)
        in current thread")."""
        prepare(self)
        draft = self.speculator.proposer if self.speculator is not None else None
        held = [self.executor.pool, getattr(self.batch, "kv", None), getattr(draft, "kv", None)]
        mx.eval([a for a in held if a is not None])

    def _serve(self, prepare: Callable[[Engine], None] | None) -> None:
        try:
            if prepare is not None:
                on_own_thread(partial(self._prepare, prepare), f"stepserve-warmup-{self.model.name}")
        except Exception as exc:  # a model that cannot run is not ready, and says why
            log.exception("warm-up failed")
            self.not_ready_reason = f"warm-up failed: {type(exc).__name__}"
            return
        self.not_ready_reason = ""
        self.executor.seal()
        # Warm-up ran every bucket's step once, the largest caches included: MLX's buffer cache
        # now holds their buffers (tens of GB on a GPU host) that serving may never need again.
        # Give them back before serving (mx.clear_cache; a step reallocates what it uses).
        mx.clear_cache()
        self.ready.set()
        while not self._stop.is_set():
            try:
                if self._abort.is_set():
                    self._end_all(FinishReason.CANCELLED, SHUTDOWN)
                if not self.step():
                    self.executor.idle()
                    self.scheduler.wait_for_work(IDLE_WAIT_S)
            except Exception as exc:
                log.exception("engine step failed")
                self.executor.raise_if_fatal(exc)
                self._end_all(FinishReason.ERROR, f"internal error in the engine step: {type(exc).__name__}")
        self._end_all(FinishReason.CANCELLED, SHUTDOWN)
        self.executor.close()

    def step(self) -> bool:
        """One iteration: the scheduler plans; the prefiller runs the admitted prompts and the
        decode batch takes those that are done; a verify step or a plain step decodes the
        batch; the engine applies what each returned.

        Returns whether there was anything to do (False: the engine may sleep).
        """
        start, waited = time.perf_counter(), self.executor.wait_seconds
        plan = self.scheduler.schedule()
        if self._prefix_evict:
            self.prefix.evict(self._prefix_evict)
            self._prefix_evict = 0
        for seq, reason in plan.aborted:
            self._finish(seq, reason)
        if plan.prefill:
            self._apply(self.prefill(plan.prefill))
            self._record_moves(self.batch.join([s for s in plan.prefill if s.finish_reason is None]))
        if self.paged is not None:
            self._make_room(plan.prefill)
        busy = self.runner.busy
        self._apply(self._decode())
        if plan.prefill:  # after the first tokens went out and the decode step is queued
            self.save_prefixes()
        # A paged pool also evicts and caches blocks between prefills (a row's next block, a
        # request that ended): its counters are compared each step, recorded when they moved.
        if plan.prefill or (self.paged is not None and self.paged.prefix_moved):
            stat = self.take_prefix_stat()
            if self.ready.is_set():  # the warm-up rehearsal's lookups are not served traffic
                self.metrics.record_prefix_cache(stat)
        selector = self.selector
        if selector.masks and self.ready.is_set():
            self.metrics.grammar_masks.labels(self.model.name).inc(selector.masks)
            self.metrics.grammar_mask_seconds.labels(self.model.name).inc(selector.mask_seconds)
        selector.masks, selector.mask_seconds = 0, 0.0
        worked = bool(plan.prefill or plan.aborted or busy)
        if worked and self.ready.is_set():
            wait = self.executor.wait_seconds - waited
            self.metrics.engine_seconds.labels(self.model.name, "wait").inc(wait)
            self.metrics.engine_seconds.labels(self.model.name, "host").inc(
                max(0.0, time.perf_counter() - start - wait)
            )
        return worked

    # -- prefill and the prefix cache (engine thread) --------------------------------------

    def prefill(self, seqs: list[Sequence]) -> RunnerOutput:
        """Advance each scheduled request's prompt by one chunk, or whole (:meth:`Prefiller.run`),
        a request admitted this step first starting from the prefix cache's blocks
        (:meth:`match_prefix`). What earlier prefills left unsaved is saved first, so that this
        step's lookups find it. Called on the engine thread (or with the thread not started)."""
        self.save_prefixes()
        failed: list[tuple[Sequence, str]] = []
        gathered: dict | None = {} if self.executor.batches_chunks else None  # this step's, by hit
        for seq in seqs:
            if seq.started is None:  # admitted this step
                seq.started = time.perf_counter()
                try:
                    self.match_prefix(seq, gathered)
                except Exception as exc:  # one failed request must not take the others down
                    self.executor.raise_if_fatal(exc)
                    failed.append((seq, f"prefill failed: {type(exc).__name__}"))
        lost = {id(seq) for seq, _ in failed}
        out = self.prefiller.run([s for s in seqs if id(s) not in lost])
        out.failed = failed + out.failed
        return out

    def match_prefix(self, seq: Sequence, gathered: dict | None = None) -> None:
        """Start ``seq``'s staging cache from the prefix cache's blocks, if it has any.

        ``gathered``: staging caches already gathered this step, by hit and capacity (:meth:`prefill`
        passes one where the executor batches last chunks: one process on a GPU). Requests of
        one step that hit the same blocks at the same staging capacity (chats sharing a system
        prompt) then share one gathered cache: MLX arrays are immutable and a chunk step returns
        a new cache, so each request still prefills into its own. (A pipeline group's rank 0
        names each cache by a handle that its chunk step moves to the result, so there every
        request gathers its own.) None: gather for this request alone.

        With a paged pool the hit is the pool's blocks the request took at admission
        (:meth:`_fits`; one that holds none yet takes them now, raising NoFreeBlocks when the
        pool cannot give them), read into the staging cache (:meth:`Executor.read_blocks`), or,
        where prompts prefill in blocks (:attr:`Executor.in_blocks`), read by the chunk step
        itself: nothing is copied."""
        if self.paged is not None:
            self._match_pool(seq, gathered)
            return
        hit = self.prefix.match(seq.prefill_ids)
        if hit.num_tokens == 0:
            return
        capacity = self.prefiller.staging_capacity(len(seq.prefill_ids), hit.num_tokens)
        if gathered is None:
            seq.staging = self.prefix.gather(hit, capacity)  # [1, Hkv, C, D] per layer
        else:
            key = (*(id(b) for b in hit.blocks), capacity)  # the blocks are kept with it: their ids stay theirs
            if key not in gathered:
                gathered[key] = (hit.blocks, self.prefix.gather(hit, capacity))
            seq.staging = gathered[key][1]
        seq.num_computed = seq.cached_tokens = hit.num_tokens

    def _match_pool(self, seq: Sequence, gathered: dict | None) -> None:
        """:meth:`match_prefix` from the paged pool's blocks (see there)."""
        paged = self.paged
        assert paged is not None
        pool = paged.blocks
        if id(seq) not in pool:
            pool.allocate(id(seq), seq.prefill_ids)
        hit = pool.num_computed(id(seq))
        if hit == 0:
            return
        seq.num_computed = seq.cached_tokens = hit
        if self.executor.in_blocks:
            return
        blocks = pool.block_table(id(seq))[: hit // pool.block_tokens]
        capacity = self.prefiller.staging_capacity(len(seq.prefill_ids), hit)
        if gathered is None:
            seq.staging = self.executor.read_blocks(blocks, capacity)
        else:
            key = (*blocks, capacity)  # block ids: the hit blocks stay held while this step prefills
            if key not in gathered:
                gathered[key] = (blocks, self.executor.read_blocks(blocks, capacity))
            seq.staging = gathered[key][1]

    def take_prefix_stat(self) -> PrefixCacheStat:
        """The prefix cache's counters since the previous call and the bytes it holds (with a
        paged pool: its hits at admission and its cached blocks)."""
        if self.paged is not None:
            return self.paged.take_prefix_stat(self.model.name)
        return self.prefix.take_stat(self.model.name)

    def forget_prefixes(self) -> None:
        """Empty the prefix cache (the prefix cache's blocks, or a paged pool's cached blocks),
        its counters' increase dropped uncounted (the warm-up rehearsal's dummy prompts)."""
        self.prefix.evict(self.prefix.nbytes)
        if self.paged is not None:
            self.paged.blocks.evict_cached()
        self.take_prefix_stat()

    def save_prefixes(self) -> None:
        """Store the full blocks of the prompts prefilled since the last call in the prefix
        cache (:meth:`Prefiller.take_saves`, :meth:`PrefixCache.insert_rows`).

        :meth:`step` calls it once the step's first tokens are sent and its decode step is
        queued: the block copies are then off the path to a first token, and still stored
        before the next step's prefix lookups. Raises ValueError as ``insert_rows``.
        """
        for prompts, kv in self.prefiller.take_saves():
            self.prefix.insert_rows(prompts, kv)

    # -- the paged pool (engine thread) -------------------------------------------------------

    def _make_room(self, prefilled: list[Sequence]) -> None:
        """Before a paged decode step: requeue the requests prefilled this step that found no
        blocks to join, then, while the running rows' next positions need more blocks than the
        pool has, preempt the most recently arrived running request (vLLM v1's policy: free its
        blocks, queue it first; on resume it prefills its prompt and output again). A step in
        flight is read back first, so no preempted row has a token on the way."""
        batch = self.paged
        assert batch is not None
        for seq in prefilled:
            if seq.prefilled is not None and seq.finish_reason is None:
                self._preempt(seq)
        if not batch.blocks_short(batch.live):
            return
        if self.runner.in_flight:
            self._apply(self.runner.drain())
        while (live := batch.live) and batch.blocks_short(live):
            self._preempt(max(live, key=lambda s: s.order))

    def _fits(self, seq: Sequence) -> bool:
        """Whether a waiting request may be admitted: always with a static cache; with a paged
        pool, when the pool can give the blocks of its prompt not already cached (and of its
        first decode position) while keeping one block per request already running or
        prefilling for their next steps (vLLM v1 admits by the blocks a prompt needs, with a
        small reserve; cached blocks no request holds count as available, evicted least
        recently used first). An admitted request takes its prompt's blocks at once, its
        prefix hit's referenced (:meth:`BlockPool.allocate`), so that the next admission of
        the same step counts what this one took. Called by the scheduler, on the engine thread.

        **A shared prefix in flight.** A request whose prompt's next full blocks, after those
        published, are pending in a request being prefilled (:meth:`BlockPool.pending`: chats
        sharing a system prompt arriving together) is not admitted yet when the shared prefix,
        published and pending, spans at least one chunk (``prefill_chunk_tokens``). It keeps its
        place at the head of the queue (those behind it wait too: first come, first served)
        until the owner has published those blocks, and is then admitted with a prefix hit on
        them, instead of computing and holding the same blocks again (N such chats took N times
        the prefill and the blocks). The cost: the deferred request waits for the owner's
        prefill of the shared part, which it would otherwise compute itself in about as many
        steps. Where prompts prefill in their blocks the owner publishes its full blocks after
        each chunk (:meth:`Prefiller.run`); on the staging path only at join, once its whole
        prompt is in, so there the wait also covers the owner's own rest of the prompt. A shared
        prefix of less than a chunk (short prompts, whose whole prefill is one call) is computed
        again rather than waited for: the request computes it beside the owner in the same step
        (one prompt sent twice at once still shares a prefill row). It never deadlocks: the
        owner's prefill advances every step, and an owner cancelled, failed, finished or
        preempted drops its pending blocks (:meth:`BlockPool.free`), so the request is then
        admitted and computes what was not published."""
        batch = self.paged
        if batch is None:
            return True
        blocks, ids = batch.blocks, seq.prefill_ids
        if id(seq) in blocks:
            return True
        waits = blocks.pending(ids)  # blocks of its prefix another request is computing now
        if waits and blocks.peek(ids) + waits * blocks.block_tokens >= self.scheduler.chunk_tokens:
            return False  # a shared prefix of a chunk or more in flight: hit it once published
        reserve = blocks.blocks_for(len(ids) + 1) - blocks.blocks_for(len(ids)) + self.scheduler.num_running
        try:
            blocks.allocate(id(seq), ids, reserve)
        except NoFreeBlocks:
            return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Take ``seq``'s slot and blocks back and queue it first (:meth:`Sequence.preempt`)."""
        batch = self.paged
        assert batch is not None
        batch.vacate(seq)
        batch.free(seq, publish=True)  # its prompt and output's full blocks: its resumption hits them
        seq.preempt()
        self.scheduler.preempt(seq)
        batch.preemptions += 1
        log.info("request %s preempted (KV pool full): it resumes first", seq.request_id)
        if self.ready.is_set():
            self.metrics.preemptions.labels(self.model.name).inc()

    # -- decode and applying outputs (engine thread) ---------------------------------------

    def _decode(self) -> RunnerOutput:
        """Decode the batch: a verify step when speculation pays (:meth:`Speculator.plan`; a
        plain step still in flight is read back first, and returned: its tokens must reach
        the requests before anything is proposed), else the runner's pipelined plain step."""
        spec = self.speculator
        if spec is not None and (proposals := spec.plan(self.batch)) is not None:
            if self.runner.in_flight:
                return self.runner.drain()
            return spec.verify(self.batch, proposals)
        # With speculation on, plain steps keep a verify step's room too: no capacity move back and forth.
        return self.runner.decode_requests(extra=spec.tokens if spec is not None else 0)

    def _apply(self, out: RunnerOutput) -> None:
        """Append each new token to its request and finish the requests that stop."""
        if self.ready.is_set():  # the warm-up rehearsal's steps are not served traffic
            for stat in out.steps:
                self.metrics.record_step(stat)
            for spec in out.spec:
                self.metrics.record_speculation(spec)
            self._record_moves(out.moves)
        for seq, message in out.failed:
            log.error("request %s failed: %s", seq.request_id, message)
            self._finish(seq, FinishReason.ERROR, message)
        for seq, key in out.keys:  # before a request that stops at its first token releases its key
            self.batch.keep_key(seq, key)
        stop_ids = self.model.tokenizer.stop_token_ids
        for seq, token in out.tokens:
            if seq.finish_reason is not None:  # a verify step's tokens after the one it stopped at
                continue
            seq.append(token, stop_ids, self.capacity_limit)
            if seq.finish_reason is not None:
                self._finish(seq)

    def _finish(self, seq: Sequence, reason: FinishReason | None = None, error: str | None = None) -> None:
        """The one place a request ends: free its slot and key, leave the scheduler, record
        its metrics and send its final event."""
        if reason is not None:  # before the release: a paged pool keeps a failed request's blocks unpublished
            seq.finish_reason = reason
        self.batch.release(seq)
        self.scheduler.finish(seq)
        final = seq.final_event(error)
        if seq.warmup:
            seq.emit(final)
            return
        stat = RequestStat(
            self.model.name,
            final.finish_reason.value,
            final.prompt_tokens,
            final.completion_tokens,
            final.total_s,
            final.ttft_s,
            tuple(seq.inter_token_s),
            shutdown=error == SHUTDOWN,
            queue_s=None if seq.started is None else seq.started - seq.arrival,
        )
        self.metrics.record_request(stat)
        seq.emit(final)

    def _end_all(self, reason: FinishReason, message: str) -> None:
        """End every running and waiting request with ``reason`` and drop the batch."""
        for seq in self.scheduler.abort_all(reason):
            self._finish(seq, reason, message)
        self._drop_batch()

    def _drop_batch(self) -> None:
        """Forget the decode batch and the step in flight (every request was ended)."""
        self.runner.abort()
        self.batch.abort()

    def _record_moves(self, moves: list[str]) -> None:
        for kind in moves:
            self.metrics.bucket_moves.labels(self.model.name, kind).inc()
