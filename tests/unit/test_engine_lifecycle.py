"""The engine's API for the rest of the process, on a tiny random model: a request cancelled
with a reason ends with that reason, a dead engine's requests end through the same finish
path as any other (metrics included), and start-up derives max_sequences from the budget."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import pytest
from prometheus_client import CollectorRegistry

from models.loader import LoadedModel
from service.config import load_settings
from service.engine.buckets import BucketTable
from service.engine.sequence import FinalEvent, FinishReason, SamplingParams, Sequence
from service.engine.warmup import WarmupSpec
from service.metrics import Metrics
from service.process.memory import worst_case
from service.process.startup import MemoryBudgetError, buckets_of, check_memory
from tests.support import TINY, WordTokenizer, engine_at, random_params, start_engine

BUCKETS = BucketTable(batch=(1, 2, 4), prompt=(8, 16), capacity=(16, 32))


@pytest.fixture
def model() -> LoadedModel:
    tokenizer = WordTokenizer(frozenset())
    return LoadedModel("tiny", Path("-"), TINY, random_params(), tokenizer, mx.float32, "dequantized", 0.0)


def request(model: LoadedModel, max_tokens: int = 200) -> tuple[Sequence, list[FinalEvent], threading.Event]:
    finals: list[FinalEvent] = []
    ended = threading.Event()

    def emit(event):
        if isinstance(event, FinalEvent):
            finals.append(event)
            ended.set()

    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=max_tokens), model.tokenizer.detokenizer(), emit)
    return seq, finals, ended


def sample(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_cancel_with_a_reason_ends_the_request_with_it(model):
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    engine = engine_at(model, BUCKETS, metrics)
    start_engine(engine, WarmupSpec(prompt_tokens=0))
    assert engine.ready.wait(60)
    try:
        seq, finals, ended = request(model, max_tokens=10)
        engine.submit(seq)
        engine.cancel(seq, FinishReason.TIMEOUT)
        assert ended.wait(60)
    finally:
        engine.stop()
    assert [f.finish_reason for f in finals] == [FinishReason.TIMEOUT]
    assert (
        sample(metrics, "stepserve_timeouts_total", model="tiny", reason="waiting")
        + sample(metrics, "stepserve_timeouts_total", model="tiny", reason="running")
        == 1
    )
    assert engine.idle and not engine.runner.busy


def test_a_dead_engines_requests_end_through_the_one_finish_path(model):
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    engine = engine_at(model, BUCKETS, metrics)
    # Never started, as after its thread died: the requests it holds wait forever unless failed.
    running, waiting = request(model), request(model)
    engine.submit(running[0])
    engine.submit(waiting[0])
    engine.scheduler.schedule()  # the first becomes running, as the thread would have done
    engine.fail("the engine thread died; the server is restarting")
    for _, finals, ended in (running, waiting):
        assert ended.is_set()
        assert finals[0].finish_reason is FinishReason.ERROR and "engine thread died" in (finals[0].error or "")
    assert sample(metrics, "stepserve_request_duration_seconds_count", model="tiny") == 2
    assert not engine.ready.is_set() and engine.not_ready_reason == "engine thread died"
    assert engine.idle and engine.load() == []


def settings_for(tmp_path, **values):
    toml = tmp_path / "s.toml"
    toml.write_text(
        "batch_buckets = [1, 2, 4]\nprompt_buckets = [8, 16]\ncapacity_buckets = [16, 32]\n"
        "prefill_chunk_tokens = 16\nmax_batched_tokens = 32\nprefix_cache_bytes = 0\n"
    )
    return load_settings(toml, model_name="tiny", **values)


def test_unset_max_sequences_is_the_largest_batch_that_fits_the_budget(tmp_path, model):
    settings = settings_for(tmp_path)
    spec = settings.served_models()[0]
    need = {b: worst_case(model, buckets_of(spec, model), b, 16, 32).total for b in (1, 2, 4)}
    budget = (need[2] + need[4]) // 2  # room for 2 running sequences, not 4
    resolved = check_memory(settings_for(tmp_path, memory_budget_bytes=budget), {"tiny": model})
    assert resolved.served_models()[0].max_sequences == 2
    assert check_memory(settings_for(tmp_path, memory_budget_bytes=need[4]), {"tiny": model}).max_sequences == 4
    with pytest.raises(MemoryBudgetError, match="memory_budget_bytes"):
        check_memory(settings_for(tmp_path, memory_budget_bytes=need[1] - 1), {"tiny": model})


def test_an_explicit_max_sequences_over_the_budget_is_refused(tmp_path, model):
    spec = settings_for(tmp_path).served_models()[0]
    need_1 = worst_case(model, buckets_of(spec, model), 1, 16, 32).total
    with pytest.raises(MemoryBudgetError, match="lower max_sequences"):
        check_memory(settings_for(tmp_path, memory_budget_bytes=need_1, max_sequences=4), {"tiny": model})


def test_warm_up_gives_mlx_buffer_cache_back_before_serving(model):
    """Warm-up runs the largest steps once; what MLX's buffer cache kept of them is freed before
    the engine reports ready (``mx.clear_cache``), so a server does not sit on that memory."""
    engine = engine_at(model, BUCKETS)
    mx.eval(mx.zeros((1 << 22,)) + 1)  # something in the buffer cache before warm-up, too
    start_engine(engine, WarmupSpec(prompt_tokens=8, batch=4))
    try:
        assert engine.ready.wait(60)
        # The 16 MB above and warm-up's buffers are gone; the warm-up thread's own thread-local
        # scratch (a few hundred bytes) may come back to the cache as that thread ends.
        assert mx.get_cache_memory() < 4096
    finally:
        engine.stop()


def test_the_warm_up_runs_on_a_thread_of_its_own_and_requests_on_the_engine_thread(model):
    """Warm-up's allocations stay off the engine thread's malloc arena (Engine._serve): the
    prepare callable runs on another thread, which has ended before the first request runs."""
    engine = engine_at(model, BUCKETS, Metrics(CollectorRegistry(), version="test", device="cpu"))
    seen: dict[str, threading.Thread] = {}
    step = engine.step

    def prepare(e):
        seen["warm-up"] = threading.current_thread()

    def recording_step():
        seen.setdefault("step", threading.current_thread())
        return step()

    engine.step = recording_step
    engine.start(prepare)
    assert engine.ready.wait(60), engine.not_ready_reason
    try:
        seq, finals, ended = request(model, max_tokens=3)
        engine.submit(seq)
        assert ended.wait(60)
    finally:
        engine.stop()
    assert finals[0].finish_reason is FinishReason.LENGTH
    assert seen["step"] is engine._thread
    assert seen["warm-up"] is not engine._thread and not seen["warm-up"].is_alive()


def test_a_failing_warm_up_leaves_the_engine_not_ready_saying_so(model):
    engine = engine_at(model, BUCKETS, Metrics(CollectorRegistry(), version="test", device="cpu"))

    def prepare(e):
        raise RuntimeError("no memory for the largest bucket")

    engine.start(prepare)
    thread = engine._thread
    assert thread is not None
    thread.join(60)
    assert not engine.alive and not engine.ready.is_set()
    assert engine.not_ready_reason == "warm-up failed: RuntimeError"
