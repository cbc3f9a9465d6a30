"""Every Prometheus metric of stepserve (namespace ``stepserve``, base units).

The engine and the compile cache emit plain stats objects; :class:`Metrics` records them.
Each app builds its own ``CollectorRegistry`` so tests and several apps never collide.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field

import mlx.core as mx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

# The *_created series double every counter and histogram and no dashboard reads them.
disable_created_metrics()

NAMESPACE = "stepserve"
# Latency buckets from 1 ms to 2 min: ITL is milliseconds on a GPU, a request minutes on a CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
COMPILE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
TOKENS_PER_STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
MODEL_STATES = ("loaded", "loading", "unloaded")  # stepserve_model_state's states, as GET /v1/models lists them


@dataclass(frozen=True)
class CompileStat:
    """One compile: the key's labels and the seconds of its first (tracing) call."""

    model: str
    phase: str
    bucket: str
    seconds: float


@dataclass(frozen=True)
class StepStat:
    """One engine step: its bucket, live rows out of the bucket's rows, and seconds."""

    model: str
    phase: str  # "prefill", "decode" or "embed"
    bucket: str
    rows: int
    bucket_rows: int
    seconds: float


@dataclass
class SpecStat:
    """One verify step of speculative decoding (service/engine/speculative.py): per row that
    proposed, its proposed and accepted tokens; per live row, the tokens it emitted."""

    model: str
    method: str  # "lookup" or "draft"
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    tokens_per_row: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RequestStat:
    """One finished request, as the engine saw it (seconds)."""

    model: str
    finish_reason: str  # stop, length, cancelled, timeout or error
    prompt_tokens: int
    completion_tokens: int
    duration_s: float
    ttft_s: float | None
    inter_token_s: tuple[float, ...]
    shutdown: bool = False  # cancelled because the server is shutting down
    queue_s: float | None = None  # arrival to admission by the scheduler (None: never admitted)


@dataclass(frozen=True)
class PrefixCacheStat:
    """A prefix cache's counts since its previous stat, and the bytes it holds now
    (``PrefixCache.take_stat`` in service/engine/prefix_cache.py)."""

    model: str
    queried_tokens: int  # prompt tokens looked up
    hit_tokens: int  # of those, tokens whose KV was cached
    evicted_blocks: int
    nbytes: int  # keys and values held now


@dataclass(frozen=True)
class EmbeddingStat:
    """One embedding request, as handed to the embedding engine."""

    model: str
    inputs: int
    tokens: int


class Metrics:
    """The metric objects, bound to one registry."""

    def __init__(self, registry: CollectorRegistry, *, version: str, device: str):
        ns, reg = NAMESPACE, registry
        self.registry = registry
        step = ("model", "phase", "bucket")
        self.compile_hits = Counter(
            "compile_cache_hits_total",
            "Compiled-step lookups that found the bucket compiled",
            step,
            namespace=ns,
            registry=reg,
        )
        self.compile_misses = Counter(
            "compile_cache_misses_total", "Compiled-step lookups that had to compile", step, namespace=ns, registry=reg
        )
        self.compiled_step = Gauge(
            "compiled_step",
            "1 if the bucket's step runs compiled, 0 if eager (compile policy)",
            step,
            namespace=ns,
            registry=reg,
        )
        self.compile_seconds = Histogram(
            "compile_seconds",
            "Seconds to trace and run a step the first time",
            step,
            namespace=ns,
            registry=reg,
            buckets=COMPILE_BUCKETS,
        )
        self.request_duration = Histogram(
            "request_duration_seconds",
            "Request time from arrival to last token",
            ["model"],
            namespace=ns,
            registry=reg,
            buckets=LATENCY_BUCKETS,
        )
        self.ttft = Histogram(
            "time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            ["model"],
            namespace=ns,
            registry=reg,
            buckets=LATENCY_BUCKETS,
        )
        self.queue_time = Histogram(
            "queue_time_seconds",
            "Time from arrival to admission into the running batch",
            ["model"],
            namespace=ns,
            registry=reg,
            buckets=LATENCY_BUCKETS,
        )
        self.engine_seconds = Counter(
            "engine_seconds_total",
            "Engine-thread seconds in steps: 'host' running Python and queueing work, 'wait' blocked on the "
            "device's results (host close to all of it: the server, not the device, bounds the step rate)",
            ["model", "kind"],
            namespace=ns,
            registry=reg,
        )
        self.itl = Histogram(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens",
            ["model"],
            namespace=ns,
            registry=reg,
            buckets=LATENCY_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "prompt_tokens_total", "Prompt tokens prefilled", ["model"], namespace=ns, registry=reg
        )
        self.generation_tokens = Counter(
            "generation_tokens_total", "Tokens generated", ["model"], namespace=ns, registry=reg
        )
        self.requests = Counter(
            "requests_total", "Finished requests by HTTP status code", ["status"], namespace=ns, registry=reg
        )
        self.running = Gauge("requests_running", "Requests in the running batch", ["model"], namespace=ns, registry=reg)
        self.waiting = Gauge(
            "requests_waiting", "Requests queued for the engine", ["model"], namespace=ns, registry=reg
        )
        self.batch_size = Histogram(
            "batch_size",
            "Live rows per engine step",
            ["model", "phase"],
            namespace=ns,
            registry=reg,
            buckets=BATCH_BUCKETS,
        )
        self.padding_waste = Histogram(
            "padding_waste_ratio",
            "Padded rows / bucket rows per step",
            ["model", "phase"],
            namespace=ns,
            registry=reg,
            buckets=RATIO_BUCKETS,
        )
        self.step_seconds = Histogram(
            "step_seconds",
            "Seconds per engine step (run and sample)",
            ["model", "phase", "bucket"],
            namespace=ns,
            registry=reg,
            buckets=LATENCY_BUCKETS,
        )
        self.preemptions = Counter(
            "preemptions_total",
            "Running requests whose KV blocks were taken back when the paged pool ran out (each resumes first)",
            ["model"],
            namespace=ns,
            registry=reg,
        )
        self.embedding_requests = Counter(
            "embedding_requests_total",
            "Requests to /v1/embeddings handed to an embedding model",
            ["model"],
            namespace=ns,
            registry=reg,
        )
        self.kv_blocks = Gauge(
            "kv_pool_blocks",
            "Blocks of the paged KV pool by state: used (held by requests), cached (prefix blocks), free, total",
            ["model", "state"],
            namespace=ns,
            registry=reg,
        )
        self.embedding_inputs = Counter(
            "embedding_inputs_total", "Inputs (texts or token lists) embedded", ["model"], namespace=ns, registry=reg
        )
        self.embedding_tokens = Counter(
            "embedding_tokens_total", "Tokens of the inputs embedded", ["model"], namespace=ns, registry=reg
        )
        self.embedding_steps = Counter(
            "embedding_steps_total",
            "Encoder steps run, each embedding a padded batch of inputs from one or more requests",
            ["model"],
            namespace=ns,
            registry=reg,
        )
        self.bucket_moves = Counter(
            "bucket_moves_total", "Decode-cache copies to another bucket", ["model", "kind"], namespace=ns, registry=reg
        )
        self.grammar_masks = Counter(
            "grammar_masks_total",
            "Token masks computed for structured-output rows (one per row and step)",
            ["model"],
            namespace=ns,
            registry=reg,
        )
        self.grammar_mask_seconds = Counter(
            "grammar_mask_seconds_total",
            "Host seconds spent computing structured-output token masks",
            ["model"],
            namespace=ns,
            registry=reg,
        )
        self.queue_rejections = Counter(
            "queue_rejections_total",
            "Requests refused before queueing",
            ["model", "reason"],
            namespace=ns,
            registry=reg,
        )
        self.cancellations = Counter(
            "cancellations_total", "Requests cancelled", ["model", "reason"], namespace=ns, registry=reg
        )
        self.timeouts = Counter(
            "timeouts_total", "Requests that reached the time limit", ["model", "reason"], namespace=ns, registry=reg
        )
        self.prefix_queried = Counter(
            "prefix_cache_queried_tokens_total",
            "Prompt tokens looked up in the prefix cache",
            ["model"],
            namespace=ns,
            registry=reg,
        )
        self.prefix_hits = Counter(
            "prefix_cache_hit_tokens_total",
            "Prompt tokens whose KV the prefix cache held (not prefilled)",
            ["model"],
            namespace=ns,
            registry=reg,
        )
        self.prefix_evictions = Counter(
            "prefix_cache_evictions_total",
            "Blocks evicted from the prefix cache",
            ["model"],
            namespace=ns,
            registry=reg,
        )
        self.prefix_bytes = Gauge(
            "prefix_cache_bytes",
            "Bytes of keys and values the prefix cache holds",
            ["model"],
            namespace=ns,
            registry=reg,
        )
        self.spec_proposed = Counter(
            "speculative_proposed_tokens_total",
            "Tokens proposed to speculative decoding's verify steps",
            ["model", "method"],
            namespace=ns,
            registry=reg,
        )
        self.spec_accepted = Counter(
            "speculative_accepted_tokens_total",
            "Proposed tokens the target model accepted",
            ["model", "method"],
            namespace=ns,
            registry=reg,
        )
        self.spec_acceptance = Histogram(
            "speculative_acceptance_ratio",
            "Accepted / proposed tokens of one row in one verify step",
            ["model", "method"],
            namespace=ns,
            registry=reg,
            buckets=RATIO_BUCKETS,
        )
        self.spec_tokens = Histogram(
            "speculative_tokens_per_step",
            "Tokens one row emitted in one verify step (1 without an accepted proposal)",
            ["model", "method"],
            namespace=ns,
            registry=reg,
            buckets=TOKENS_PER_STEP_BUCKETS,
        )
        self.model_state = Gauge(
            "model_state",
            "1 for a model's current state (loaded, loading, unloaded), 0 for the others; on-demand models load "
            "on their first request and unload after ttl_s idle",
            ["model", "state"],
            namespace=ns,
            registry=reg,
        )
        self.model_loads = Counter(
            "model_loads_total",
            "On-demand model loads (weights, memory check, warm-up) by outcome: 'loaded' or 'failed'",
            ["model", "outcome"],
            namespace=ns,
            registry=reg,
        )
        self.model_load_seconds = Histogram(
            "model_load_seconds",
            "Seconds from an on-demand model's first request to its engine ready",
            ["model"],
            namespace=ns,
            registry=reg,
            buckets=COMPILE_BUCKETS + (120, 300, 600),
        )
        self.model_unloads = Counter(
            "model_unloads_total", "On-demand models unloaded after ttl_s idle", ["model"], namespace=ns, registry=reg
        )
        self.active_memory = Gauge("mlx_active_memory_bytes", "MLX memory in use", namespace=ns, registry=reg)
        self.active_memory.set_function(mx.get_active_memory)
        self.peak_memory = Gauge("mlx_peak_memory_bytes", "MLX peak memory since start", namespace=ns, registry=reg)
        self.peak_memory.set_function(mx.get_peak_memory)
        info = Gauge(
            "build_info",
            "Build information (value 1)",
            ["version", "mlx_version", "device"],
            namespace=ns,
            registry=reg,
        )
        info.labels(version, importlib.metadata.version("mlx"), device).set(1)
        for status in ("200", "400", "401", "413", "422", "429", "499", "500", "503", "504"):
            self.requests.labels(status)  # zero series from the start, so rate() sees the first one

    def init_model(self, model: str) -> None:
        """Create a model's labelled counters at zero, so that Prometheus' ``rate()`` and
        ``increase()`` count their first event (a series born at 1 is invisible to them)."""
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_queried,
            self.prefix_hits,
            self.prefix_evictions,
            self.prefix_bytes,
            self.preemptions,
        ):
            metric.labels(model)
        for reason in ("queue_full", "draining", "memory"):
            self.queue_rejections.labels(model, reason)
        for reason in ("client_disconnected", "shutdown"):
            self.cancellations.labels(model, reason)
        for reason in ("waiting", "running"):
            self.timeouts.labels(model, reason)
        for kind in ("host", "wait"):
            self.engine_seconds.labels(model, kind)

    def set_model_state(self, model: str, state: str) -> None:
        """Mark ``model``'s ``state`` (``loaded``, ``loading`` or ``unloaded``) as its current one."""
        for each in MODEL_STATES:
            self.model_state.labels(model, each).set(int(each == state))

    def init_on_demand(self, model: str) -> None:
        """An on-demand model's series at zero, unloaded (see :meth:`init_model`)."""
        self.set_model_state(model, "unloaded")
        for outcome in ("loaded", "failed"):
            self.model_loads.labels(model, outcome)
        self.model_unloads.labels(model)

    def release_model(self, model: str) -> None:
        """An unloaded model's live gauges read 0 and let go of its engine (whose scheduler
        they read), so that its weights and caches can be freed."""
        self.running.labels(model).set_function(lambda: 0)
        self.waiting.labels(model).set_function(lambda: 0)

    def init_embedding(self, model: str) -> None:
        """Create an embedding model's counters at zero (see :meth:`init_model`)."""
        for metric in (self.embedding_requests, self.embedding_inputs, self.embedding_tokens, self.embedding_steps):
            metric.labels(model)

    def record_embedding(self, stat: EmbeddingStat) -> None:
        """Count one embedding request, its inputs and their tokens."""
        self.embedding_requests.labels(stat.model).inc()
        self.embedding_inputs.labels(stat.model).inc(stat.inputs)
        self.embedding_tokens.labels(stat.model).inc(stat.tokens)

    def init_speculative(self, model: str, method: str) -> None:
        """Create a speculating model's counters and histograms at zero (see :meth:`init_model`:
        a series born between two scrapes has no rate until its next increase)."""
        for metric in (self.spec_proposed, self.spec_accepted, self.spec_acceptance, self.spec_tokens):
            metric.labels(model, method)

    def record_speculation(self, stat: SpecStat) -> None:
        """Record one verify step's proposals, acceptances and tokens per row."""
        labels = (stat.model, stat.method)
        self.spec_proposed.labels(*labels).inc(sum(stat.proposed))
        self.spec_accepted.labels(*labels).inc(sum(stat.accepted))
        ratio = self.spec_acceptance.labels(*labels)
        for proposed, accepted in zip(stat.proposed, stat.accepted, strict=True):
            ratio.observe(accepted / proposed)
        tokens = self.spec_tokens.labels(*labels)
        for n in stat.tokens_per_row:
            tokens.observe(n)

    def record_lookup(self, model: str, phase: str, bucket: str, hit: bool) -> None:
        """Count one compile-cache lookup."""
        (self.compile_hits if hit else self.compile_misses).labels(model, phase, bucket).inc()

    def record_compile(self, stat: CompileStat) -> None:
        self.compile_seconds.labels(stat.model, stat.phase, stat.bucket).observe(stat.seconds)

    def record_request(self, stat: RequestStat) -> None:
        """Record a request the engine finished (successfully or not)."""
        self.prompt_tokens.labels(stat.model).inc(stat.prompt_tokens)
        self.generation_tokens.labels(stat.model).inc(stat.completion_tokens)
        self.request_duration.labels(stat.model).observe(stat.duration_s)
        if stat.ttft_s is not None:
            self.ttft.labels(stat.model).observe(stat.ttft_s)
        if stat.queue_s is not None:
            self.queue_time.labels(stat.model).observe(stat.queue_s)
        itl = self.itl.labels(stat.model)
        for gap in stat.inter_token_s:
            itl.observe(gap)
        if stat.finish_reason == "cancelled":
            self.cancellations.labels(stat.model, "shutdown" if stat.shutdown else "client_disconnected").inc()
        elif stat.finish_reason == "timeout":
            self.timeouts.labels(stat.model, "running" if stat.ttft_s is not None else "waiting").inc()

    def record_step(self, stat: StepStat) -> None:
        """Record one prefill or decode step."""
        self.batch_size.labels(stat.model, stat.phase).observe(stat.rows)
        self.padding_waste.labels(stat.model, stat.phase).observe(1 - stat.rows / stat.bucket_rows)
        self.step_seconds.labels(stat.model, stat.phase, stat.bucket).observe(stat.seconds)

    def record_prefix_cache(self, stat: PrefixCacheStat) -> None:
        """Record a prefix cache's counts since its previous stat and the bytes it holds."""
        self.prefix_queried.labels(stat.model).inc(stat.queried_tokens)
        self.prefix_hits.labels(stat.model).inc(stat.hit_tokens)
        self.prefix_evictions.labels(stat.model).inc(stat.evicted_blocks)
        self.prefix_bytes.labels(stat.model).set(stat.nbytes)

    def record_status(self, status: int) -> None:
        """Count a finished HTTP request by status code."""
        self.requests.labels(str(status)).inc()
