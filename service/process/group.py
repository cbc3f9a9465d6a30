"""A pipeline group's processes (docs/DISTRIBUTED.md): joining the ``mx.distributed`` group,
the split by memory, loading this rank's stage and checking its memory, the start-up check of
every rank, and the loop of the ranks that do not serve HTTP.

Every rank runs ``stepserve serve --distributed`` with the same settings. Start-up is two
exchanges (``all_gather``, so every rank learns every rank's result):

1. each rank reads the model's layout (shapes only) and states its memory budget; the
   stages are split so that the largest share of a budget is smallest (unequal minis get
   unequal stages);
2. each rank loads its stage, checks its own worst case against its budget
   (:func:`service.process.startup.check_memory`) and states the outcome, its MLX active
   memory and the most sequences it can hold.

If a rank failed either step, every rank raises :class:`GroupStartError` naming it (rank,
host, why) and exits 2; a rank that died outside these steps fails the exchange on the others.
A wait in either exchange that outlasts 10 x ``distributed_timeout_s`` (a rank hung) ends the
process. Then rank 0 serves HTTP and the others :func:`follow`.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import mlx.core as mx

from models import paged_kernel
from models.adapter import AdapterArgs, StageTraits
from models.architectures import uses_mlx_lm
from models.loader import LoadedModel, device_name
from models.pipeline import Stage, plan_stages
from models.stage_loader import ModelLayout, load_stage, model_layout
from models.tokenizer import ChatTokenizer
from service.config import Settings
from service.engine.compile_cache import CompileCache
from service.engine.executor import Executor
from service.engine.follower import Follower
from service.engine.group import GroupLost, Progress
from service.process import startup
from service.process.watchdog import ENGINE_DIED_EXIT, WARMUP_STALL_FACTOR

if TYPE_CHECKING:
    from models.lm_loader import LmLayout

log = logging.getLogger("stepserve.group")

MESSAGE_BYTES = 1024  # of a failed rank's reason, in the start-up exchange
KIB = 1024


class GroupStartError(RuntimeError):
    """A rank of the group could not start; the message names each such rank, its host and why."""


@dataclass(frozen=True)
class RankInfo:
    """One rank as the start-up exchange reported it (rank 0 shows them in ``/readyz``).

    Attributes:
        rank: its rank; host: its host name; pid: its process id there; layers: [start, stop)
        of its stage; weights_bytes: its stage's parameters; active_bytes: MLX's active memory
        once loaded; max_sequences: the most running sequences its memory budget allows.
    """

    rank: int
    host: str
    pid: int
    layers: tuple[int, int]
    weights_bytes: int
    active_bytes: int
    max_sequences: int


@dataclass
class GroupStart:
    """What a rank starts serving with: the settings (``max_sequences``: the least any rank
    allows), its stage and every rank's report."""

    group: mx.distributed.Group
    settings: Settings
    model: LoadedModel
    ranks: list[RankInfo]


def init_group(settings: Settings) -> mx.distributed.Group:
    """Join the group ``mlx.launch`` set up (``distributed_backend``).

    Raises:
        GroupStartError: no group to join (not started by ``mlx.launch`` / ``stepserve launch``).
    """
    try:
        return mx.distributed.init(strict=True, backend=settings.distributed_backend)
    except RuntimeError as exc:
        raise GroupStartError(
            f"--distributed: cannot join an mx.distributed group ({exc}); start every rank with "
            "'stepserve launch' (or mlx.launch)"
        ) from exc


def start_group(settings: Settings, group: mx.distributed.Group) -> GroupStart:
    """Split the model, load this rank's stage and check every rank (see the module doc).

    Raises:
        GroupStartError: some rank could not start (the same message on every rank).
    """
    settings = startup.resolve_kv_cache(settings, {}, device_name(), group=True)  # 'auto': static in a group
    spec = settings.served_models()[0]
    dtype, weights = startup.compute_dtype(spec.dtype), startup.weights_mode(spec.weights)
    budget = startup.memory_budget(settings)
    layout: ModelLayout | LmLayout | None = None
    error = None
    try:
        path = startup.model_path(spec.path)
        if uses_mlx_lm(Path(path), spec.model_impl):  # mlx-lm's class: its PipelineMixin splits it
            from models.lm_loader import lm_layout  # imports mlx-lm: only for its models

            layout = lm_layout(Path(path), dtype, weights)
            error = speculative_error(spec.speculative)
        else:
            layout = model_layout(path, dtype, weights)
            error = unsupported(layout.args.model_type, spec.speculative)
    except Exception as exc:  # reported by every rank below
        error = str(exc)
    reports = _exchange(group, [budget // KIB], error, settings, "the model's layout")
    budgets = [r[0] * KIB for r, _ in reports]
    stages = split(cast("ModelLayout | LmLayout", layout), settings, budgets, group.size(), dtype.size)
    stage = stages[group.rank()]
    model, resolved, error = None, settings, None
    try:
        model = _load(settings, stages, group, dtype, weights)
        if (error := startup.paged_error(settings.kv_cache, model)) is not None:
            error = f"--distributed: {error}"
        else:
            resolved = startup.check_memory(_rank_settings(settings, stages, stage), {model.name: model})
    except Exception as exc:
        error = str(exc)
    mine = [resolved.served_models()[0].max_sequences or 0, stage.start, stage.stop]
    mine += [(model.nbytes if model else 0) // KIB, mx.get_active_memory() // KIB, os.getpid()]
    mine += [model.args.traits().packed() if model and isinstance(model.args, AdapterArgs) else 0]
    mine += [resolved.served_models()[0].kv_pool_tokens or 0]  # kv_cache = 'paged': this rank's pool, tokens
    reports = _exchange(group, mine, error, settings, "loading the stages")
    if model is not None and isinstance(model.args, AdapterArgs):  # what rank 0's engine must know of every stage
        model.args = model.args.joined([StageTraits.unpacked(r[6]) for r, _ in reports])
    ranks = [RankInfo(i, host, r[5], (r[1], r[2]), r[3] * KIB, r[4] * KIB, r[0]) for i, (r, host) in enumerate(reports)]
    least = min(r.max_sequences for r in ranks)
    for r in ranks:
        log.info(
            "rank %d on %s (pid %d): layers %d-%d, %.1f MB of weights, MLX active memory %.1f MB, up to %d sequences",
            r.rank,
            r.host,
            r.pid,
            r.layers[0],
            r.layers[1] - 1,
            r.weights_bytes / 1e6,
            r.active_bytes / 1e6,
            r.max_sequences,
        )
    final = settings.model_copy(update={"max_sequences": least})
    if settings.kv_cache == "paged":  # every rank holds rank 0's block ids: as many blocks as the least pool
        pool = min(r[7] for r, _ in reports)
        final = startup.with_pool_tokens(resolved, pool, least)
        final = final.model_copy(update={"prefix_cache_bytes": settings.prefix_cache_bytes})  # not a rank's share
        log.info("paged KV pool: %d tokens on every rank (its own layers' blocks), the least any rank holds", pool)
    return GroupStart(group, final, cast(LoadedModel, model), ranks)


#: The model types whose layers :mod:`models.pipeline` runs as stages (the Llama decoder).
PIPELINE_TYPES = ("llama", "mistral", "smollm", "qwen2", "qwen3")


def unsupported(model_type: str | None, speculative: str) -> str | None:
    """Why a group cannot serve this model with these settings, or None: only the Llama
    decoder's types are split into stages (Gemma 3's sliding-window rings and Qwen3-MoE's
    experts are not), and speculative decoding's verify step runs in one process only."""
    if model_type not in PIPELINE_TYPES:
        return (
            f"--distributed: model_type '{model_type}' cannot be split into pipeline stages "
            f"(supported: {', '.join(PIPELINE_TYPES)}); serve it in one process"
        )
    return speculative_error(speculative)


def speculative_error(speculative: str) -> str | None:
    """Why a group cannot run ``speculative`` (verify runs in one process only), or None."""
    if speculative != "off":
        return (
            f"--distributed: speculative = '{speculative}' is not supported in a pipeline group; "
            "set speculative = 'off'"
        )
    return None


def split(
    layout: ModelLayout | LmLayout, settings: Settings, budgets: list[int], size: int, dtype_size: int
) -> list[Stage]:
    """The stages, by memory: each layer counts its weights and its KV cache when full (the
    largest batch bucket, or ``max_sequences``, at the largest capacity); each rank's share is
    weighed against its budget (``budgets``, bytes, per rank). An mlx-lm module's layers count
    their weights only (its caches' shapes are learnt once a stage is loaded; each rank's
    start-up check then counts them), and every rank holds its embedding, norm and head."""
    capacities = budgets if min(budgets) > 0 else None
    if not isinstance(layout, ModelLayout):  # an mlx-lm module's
        return layout.split(size, capacities)
    spec, a = settings.served_models()[0], layout.args
    rows = spec.max_sequences or spec.batch_buckets[-1]
    kv = 2 * a.num_key_value_heads * a.dim_per_head * dtype_size * rows * spec.capacity_buckets[-1]
    return plan_stages(
        [b + kv for b in layout.layer_bytes],
        layout.embed_bytes,
        layout.head_bytes,
        size,
        tied=a.tie_word_embeddings,
        capacities=capacities,
    )


def _load(
    settings: Settings, stages: list[Stage], group: mx.distributed.Group, dtype: mx.Dtype, weights
) -> LoadedModel:
    """This rank's stage: a hand-written model's stage (:func:`models.stage_loader.load_stage`),
    or an mlx-lm module cut to its layers by its ``PipelineMixin``
    (:func:`models.lm_loader.load_lm_dir`)."""
    spec, stage = settings.served_models()[0], stages[group.rank()]
    path = startup.model_path(spec.path)
    startup.log_cpu_blas()
    if uses_mlx_lm(path, spec.model_impl):
        start = time.perf_counter()
        from models.lm_loader import load_lm_dir  # imports mlx-lm: only for its models

        layers = [s.stop - s.start for s in stages]
        args, module, tokenizer = load_lm_dir(path, dtype, weights, group, layers)
        params = cast(dict, module.parameters())
        return LoadedModel(
            spec.name, path, args, params, tokenizer, dtype, weights, time.perf_counter() - start, stage, group
        )
    part = load_stage(path, stage, dtype, weights)
    tokenizer = cast(ChatTokenizer, part.tokenizer)  # None on the other ranks: only rank 0 tokenizes
    return LoadedModel(
        spec.name, part.path, part.args, part.params, tokenizer, dtype, weights, part.load_seconds, stage, group
    )


def _rank_settings(settings: Settings, stages: list[Stage], stage: Stage) -> Settings:
    """The settings this rank checks its memory with: the prefix cache's budget counts rank
    0's blocks, so a rank holding more or fewer layers holds that much more or less of it."""
    share = (stage.stop - stage.start) / (stages[0].stop - stages[0].start)
    return settings.model_copy(update={"prefix_cache_bytes": int(settings.prefix_cache_bytes * share)})


def _exchange(
    group: mx.distributed.Group, values: list[int], error: str | None, settings: Settings, step: str
) -> list[tuple[list[int], str]]:
    """Every rank's (values, host) after ``step``; raises :class:`GroupStartError` naming every
    rank whose ``error`` was set (the same on each rank)."""
    host = socket.gethostname()
    reason = f"{host}\n{error or ''}".encode()[:MESSAGE_BYTES]
    width = 2 + 8 + MESSAGE_BYTES
    row = [int(error is not None), len(reason), *values, *[0] * (8 - len(values)), *reason]
    row += [0] * (width - len(row))
    progress = Progress()
    limit = settings.distributed_timeout_s * WARMUP_STALL_FACTOR
    done = watch(progress, lambda: limit, f"the group's start ({step})")
    try:
        with progress.waiting():
            rows = mx.distributed.all_gather(mx.array([row], mx.int32), group=group)
            mx.eval(rows)
    except GroupLost as exc:
        raise GroupStartError(f"a rank of the group exited before {step} was done ({exc.__cause__})") from exc
    finally:
        done.set()
    out, failed = [], []
    for rank, r in enumerate(cast(list[list[int]], rows.tolist())):
        text = bytes(r[10 : 10 + r[1]]).decode(errors="replace")
        host_name, _, why = text.partition("\n")
        if r[0]:
            failed.append(f"rank {rank} on {host_name} could not start ({step}): {why}")
        out.append((r[2:10], host_name))
    if failed:
        raise GroupStartError("; ".join(failed))
    return out


def watch(progress: Progress, limit: Callable[[], float], what: str, poll_s: float = 0.5) -> threading.Event:
    """Start a daemon thread that ends the process with :data:`ENGINE_DIED_EXIT` when
    ``progress``'s current wait outlasts ``limit()`` seconds (a rank hung: the backend's wait
    has no timeout and cannot be interrupted). Returns the event that stops it."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(poll_s):
            stalled = progress.stalled_s()
            if stalled > limit():
                log.critical(
                    "%s: no answer from the group for %.1f s; exiting with %d", what, stalled, ENGINE_DIED_EXIT
                )
                logging.shutdown()
                os._exit(ENGINE_DIED_EXIT)

    threading.Thread(target=run, name="stepserve-group-watch", daemon=True).start()
    return stop


def follow(start: GroupStart) -> int:
    """Run rank 0's operations on this rank's stage until it stops the group (returns 0) or
    the group fails (returns :data:`ENGINE_DIED_EXIT`); a wait on rank 0 longer than
    ``distributed_timeout_s`` (10 x before warm-up is over) ends the process."""
    settings, rank = start.settings, start.group.rank()
    spec = settings.served_models()[0]
    paged_kernel.enable(settings.paged_attention_kernel)  # as rank 0's build_engine
    follower = Follower(Executor(start.model, CompileCache(spec.compile, lambda *a: None, lambda s: None)))
    timeout = settings.distributed_timeout_s
    watch(follower.progress, lambda: timeout * (WARMUP_STALL_FACTOR if follower.warming else 1), f"rank {rank}")
    log.info("rank %d (pid %d): following rank 0", rank, os.getpid())
    try:
        follower.run()
    except GroupLost as exc:
        log.critical("rank %d: %s; exiting with %d", rank, exc, ENGINE_DIED_EXIT)
        return ENGINE_DIED_EXIT
    log.info("rank %d: rank 0 stopped the group", rank)
    sys.stdout.flush()
    return 0
