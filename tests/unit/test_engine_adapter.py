"""The engine over unmodified mlx-lm model classes (:mod:`models.adapter`): tiny random models of
a plain attention (llama), a sliding-window (gemma3_text) and a recurrent-state (qwen3_next)
architecture, served by the real engine thread with continuous batching and chunked prefill,
give each request exactly mlx-lm's own greedy tokens (``mlx_lm.generate.generate_step``); so do
a prefix-cache hit and prompt-lookup speculation on llama. The features a model cannot have
(the prefix cache and speculation with a recurrent state) are off for it, with the reason."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from models.adapter import AdapterArgs
from models.loader import LoadedModel, load_model
from models.model_args import ModelArgs
from models.tokenizer import ChatTokenizer, Detokenizer
from service.bench.common import quiet_compile_cache
from service.engine.buckets import BucketTable
from service.engine.core import Engine
from service.engine.executor import Executor
from service.engine.sequence import FinalEvent, SamplingParams, Sequence
from service.engine.warmup import WarmupSpec
from service.metrics import Metrics
from service.process.memory import SCORES_BYTES, kv_bytes_per_position, prefill_bytes, state_bytes_per_row
from tests.parity.build import WIDE_HEADS, build_tiny
from tests.support import engine_at, start_engine, tiny_config, write_lm_dir

BUCKETS = BucketTable(batch=(1, 2, 4), prompt=(8, 16), capacity=(16, 32, 48))
VOCAB = 256  # the tiny configs' (tests/parity/tiny_configs.py)


@dataclass
class Vocabulary:
    """What the engine needs of a tokenizer: stop ids and a word-level detokenizer t0..t255."""

    stop_token_ids: frozenset[int] = frozenset()

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")))


def tiny_model(name: str, post_norms: float | None = None, **overrides: Any) -> LoadedModel:
    """mlx-lm's tiny random ``name`` model (float32) as the loader serves an mlx-lm directory.
    ``post_norms``: Gemma's post-attention and post-feedforward norms scale each layer's output
    to this RMS (their weights w set to post_norms - 1: Gemma's norms multiply by 1 + w), so the
    residual stream keeps more of the token's embedding and the tiny model repeats itself.
    ``overrides``: keys of its tiny config (:func:`tests.parity.build.build_tiny`)."""
    module = build_tiny(name, **overrides)
    if post_norms is not None:
        damped = [
            (k, mx.full(v.shape, post_norms - 1.0)) for k, v in tree_flatten(module.parameters()) if ".post_" in k
        ]
        assert damped, f"{name} has no post norms"
        module.update(tree_unflatten(damped))
        mx.eval(module.parameters())
    args = AdapterArgs.from_module(module)
    tokenizer = cast(ChatTokenizer, Vocabulary())  # what the engine reads of one
    return LoadedModel(name, Path("-"), args, module.parameters(), tokenizer, mx.float32, "dequantized", 0.0)


def mlx_lm_tokens(model: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy generation (its caches, its argmax sampler) of ``max_tokens`` tokens."""
    assert isinstance(model.args, AdapterArgs)
    steps = generate_step(mx.array(prompt, mx.int32), model.args.module, max_tokens=max_tokens)
    return [int(token) for token, _ in steps]


@dataclass
class Served:
    """One request's outcome: its tokens and its final event."""

    tokens: list[int]
    final: FinalEvent


def serve(engine: Engine, requests: list[tuple[list[int], int]], one_at_a_time: bool = False) -> list[Served]:
    """Run ``(prompt, max_tokens)`` requests (greedy) through ``engine``'s thread, warmed for
    prompts of 8 tokens and 2 requests, all at once or each after the previous ended."""
    start_engine(engine, WarmupSpec(prompt_tokens=8, batch=2))
    assert engine.ready.wait(120), engine.not_ready_reason
    finals: dict[int, FinalEvent] = {}
    done = threading.Semaphore(0)
    seqs = []
    try:
        for i, (prompt, max_tokens) in enumerate(requests):

            def emit(event, i=i):
                if isinstance(event, FinalEvent):
                    finals[i] = event
                    done.release()

            seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens), engine.model.tokenizer.detokenizer(), emit)
            seqs.append(seq)
            engine.submit(seq)
            if one_at_a_time:
                assert done.acquire(timeout=120), "a request never finished"
        for _ in range(0 if one_at_a_time else len(requests)):
            assert done.acquire(timeout=120), "a request never finished"
    finally:
        engine.stop()
    return [Served(list(seq.output_ids), finals[i]) for i, seq in enumerate(seqs)]


def step_by_hand(engine: Engine, requests: list[tuple[list[int], int]]) -> list[Served]:
    """Submit every ``(prompt, max_tokens)`` request (greedy) at once and step ``engine`` by hand
    until all have ended (no thread, no warm-up: a deterministic schedule, its steps compiled
    as they come)."""
    engine.ready.set()  # record metrics (nothing else reads it when stepping by hand)
    finals: dict[int, FinalEvent] = {}
    seqs = []
    for i, (prompt, max_tokens) in enumerate(requests):

        def emit(event, i=i):
            if isinstance(event, FinalEvent):
                finals[i] = event

        seqs.append(Sequence(prompt, SamplingParams(max_tokens=max_tokens), engine.model.tokenizer.detokenizer(), emit))
        engine.submit(seqs[-1])
    while not all(s.finish_reason for s in seqs) or engine.runner.busy:
        engine.step()
    return [Served(list(seq.output_ids), finals[i]) for i, seq in enumerate(seqs)]


def chunking_engine(model: LoadedModel, metrics: Metrics | None = None, **settings) -> Engine:
    """``model``'s engine prefilling in chunks of 8 tokens, 16 tokens a step, the last chunks of
    several prompts in one call (as on a GPU: ``Executor.chunk_rows``, states included)."""
    engine = engine_at(model, BUCKETS, metrics, prefill_chunk_tokens=8, max_batched_tokens=16, **settings)
    engine.executor.batches_chunks = True
    return engine


# Mixed lengths: prompts of three chunks of 8 (the first two arrive together, so their last
# chunks run in one call), of two chunks, and whole prompts of one and two prompt buckets;
# generations long enough to move capacity buckets (16 -> 32 -> 48) and, for gemma3_text
# (window 4), to wrap its rings many times.
MIXED = [
    (list(range(60, 80)), 14),
    (list(range(100, 119)), 7),
    (list(range(40, 51)), 9),
    (list(range(3, 8)), 12),
    (list(range(120, 138)), 16),
    ([9, 200, 17], 20),
]


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next"])
def test_concurrent_mixed_requests_get_mlx_lms_greedy_tokens(name, monkeypatch):
    model = tiny_model(name)
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    batched: list[int] = []
    chunk_rows = Executor.chunk_rows

    def spy(self, kvs, *args):
        batched.append(len(kvs))
        return chunk_rows(self, kvs, *args)

    monkeypatch.setattr(Executor, "chunk_rows", spy)
    served = step_by_hand(chunking_engine(model, metrics), MIXED)
    for (prompt, max_tokens), got in zip(MIXED, served, strict=True):
        expected = mlx_lm_tokens(model, prompt, max_tokens)
        assert got.tokens == expected, f"{name}, prompt of {len(prompt)}: got {got.tokens}, mlx-lm {expected}"
    chunks = metrics.registry.get_sample_value("stepserve_batch_size_count", {"model": name, "phase": "chunk"})
    assert chunks, "no prompt was prefilled in chunks"
    assert max(batched, default=0) >= 2, "no two prompts' last chunks ran in one call"
    shared = metrics.registry.get_sample_value(
        "stepserve_batch_size_bucket", {"model": name, "phase": "decode", "le": "1.0"}
    )
    decodes = metrics.registry.get_sample_value("stepserve_batch_size_count", {"model": name, "phase": "decode"})
    assert decodes and shared is not None and decodes > shared, "no decode step ran more than one row"


# Prompts for models whose recurrent layers ignore padding, with BUCKETS' prompt buckets 8 and 16
# and chunks of 8: two of exactly 8 tokens (prefilled whole together, rows of equal length), one
# of 16 (two full chunks), and lengths whose remainder below 8 runs one token per chunk call
# (two of 17: one such token, the last chunks of both in one call; 20, 19, 11: several; 5 and 3:
# only such tokens).
EXACT_ROWS = [
    (list(range(40, 48)), 9),
    (list(range(70, 78)), 12),
    (list(range(100, 117)), 7),
    (list(range(140, 157)), 6),
    (list(range(60, 80)), 10),
    (list(range(3, 8)), 16),
    (list(range(120, 136)), 8),
    ([9, 200, 17], 20),
    (list(range(180, 191)), 5),
    (list(range(20, 39)), 6),
]


class RowSpy:
    """Every prompt row the executor's prefill and chunk calls run, as (T, real tokens): a
    padding row of a batch bucket (all zero tokens, one real) is left out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.rows: list[tuple[int, int]] = []
        self.batched: list[int] = []
        prefill, chunk, chunk_rows = Executor.prefill, Executor.chunk, Executor.chunk_rows

        def spy_prefill(executor, tokens, lengths):
            self.note(tokens, lengths)
            return prefill(executor, tokens, lengths)

        def spy_chunk(executor, kv, tokens, offset, length):
            self.note([tokens], [length])
            return chunk(executor, kv, tokens, offset, length)

        def spy_chunk_rows(executor, kvs, tokens, offsets, lengths, batch):
            self.batched.append(len(kvs))
            self.note(tokens, lengths)
            return chunk_rows(executor, kvs, tokens, offsets, lengths, batch)

        monkeypatch.setattr(Executor, "prefill", spy_prefill)
        monkeypatch.setattr(Executor, "chunk", spy_chunk)
        monkeypatch.setattr(Executor, "chunk_rows", spy_chunk_rows)

    def note(self, tokens: list[list[int]], lengths: list[int]) -> None:
        self.rows += [(len(row), n) for row, n in zip(tokens, lengths, strict=True) if any(row) or n > 1]


@pytest.mark.parametrize("name", ["mamba", "nemotron_h", "recurrent_gemma"])
def test_a_model_whose_recurrent_layers_ignore_padding_prefills_exact_rows(name, monkeypatch):
    """Concurrent requests of mixed lengths, prefilled whole and in chunks: every row of every
    prefill and chunk call is full (no padding reaches a recurrent state) and each request gets
    mlx-lm's own greedy tokens."""
    model = tiny_model(name)
    assert isinstance(model.args, AdapterArgs) and not model.args.pads_prompts
    spy = RowSpy(monkeypatch)
    engine = engine_at(model, BUCKETS, prefill_chunk_tokens=8, max_batched_tokens=40)  # room for 4 prompts a step
    engine.executor.batches_chunks = True  # the last chunks of several prompts in one call, as on a GPU
    served = step_by_hand(engine, EXACT_ROWS)
    for (prompt, max_tokens), got in zip(EXACT_ROWS, served, strict=True):
        expected = mlx_lm_tokens(model, prompt, max_tokens)
        assert got.tokens == expected, f"{name}, prompt of {len(prompt)}: got {got.tokens}, mlx-lm {expected}"
    padded = [(T, n) for T, n in spy.rows if n != T]
    assert not padded, f"padded rows (T, real tokens): {padded}"
    sizes = {T for T, _ in spy.rows}
    assert {1, 8} <= sizes, f"row lengths {sizes}: no whole bucket or no one-token chunk"
    assert max(spy.batched, default=0) >= 2, "no two prompts' last chunks ran in one call"


def test_a_state_models_prompt_up_to_the_largest_capacity_is_prefilled():
    """qwen3_next (its states mask padding): chunks of 6 tokens padded to 8 reach position 42 of a
    48-token prompt, where no prompt bucket fits before the largest capacity (48); the rest
    runs a token at a time (once a BucketLimitError that failed the request mid-prefill)."""
    model = tiny_model("qwen3_next")
    prompt = [7 + (5 * i) % 240 for i in range(BUCKETS.capacity[-1])]
    served = step_by_hand(engine_at(model, BUCKETS, prefill_chunk_tokens=6, max_batched_tokens=16), [(prompt, 1)])
    assert served[0].final.error is None, served[0].final.error
    assert served[0].tokens == mlx_lm_tokens(model, prompt, 1)


def test_a_prefix_cache_hit_gives_mlx_lms_tokens():
    model = tiny_model("llama")
    system = list(range(40, 58))  # 18 tokens: 4 blocks of 4 are reusable
    requests = [(system + [3, 4], 6), (system + [5], 6), (system + [3, 4], 6)]
    engine = chunking_engine(model, prefix_cache_bytes=10**7, prefix_block_tokens=4)
    served = serve(engine, requests, one_at_a_time=True)
    for (prompt, max_tokens), got in zip(requests, served, strict=True):
        assert got.tokens == mlx_lm_tokens(model, prompt, max_tokens), f"prompt {prompt} changed by a cache hit"
    assert [s.final.cached_tokens for s in served] == [0, 16, 16]


def test_the_prefix_cache_is_off_for_a_model_with_recurrent_state(caplog):
    model = tiny_model("qwen3_next")
    with caplog.at_level(logging.INFO, logger="stepserve"):
        engine = chunking_engine(model, prefix_cache_bytes=10**7, prefix_block_tokens=4)
    assert engine.prefix.budget_bytes == 0
    assert "prefix cache off (its recurrent state cannot be cut at a block boundary)" in caplog.text
    system = list(range(40, 58))
    served = serve(engine, [(system + [3], 5), (system + [4], 5)], one_at_a_time=True)
    assert [s.final.cached_tokens for s in served] == [0, 0]
    assert served[1].tokens == mlx_lm_tokens(model, system + [4], 5)


def test_prompt_lookup_speculation_gives_the_plain_tokens():
    """Verify steps on the adapter's ``verify``, stepped by hand as the speculation tests do
    (``speculative_max_batch``: every batch bucket may speculate, no calibration)."""
    model = tiny_model("llama")
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    engine = chunking_engine(model, metrics, speculative="lookup", speculative_max_batch=4, speculative_tokens=3)
    assert engine.speculator is not None and "verify" in engine.executor._specs
    requests = [(prompt, 24) for prompt, _ in MIXED[:4]]  # the tiny llama soon repeats itself: lookup copies it
    served = step_by_hand(engine, requests)
    for (prompt, max_tokens), got in zip(requests, served, strict=True):
        assert got.tokens == mlx_lm_tokens(model, prompt, max_tokens)
    labels = {"model": "llama", "method": "lookup"}
    proposed = metrics.registry.get_sample_value("stepserve_speculative_proposed_tokens_total", labels)
    accepted = metrics.registry.get_sample_value("stepserve_speculative_accepted_tokens_total", labels)
    assert proposed and accepted and accepted < proposed, (proposed, accepted)  # accepted and rolled back


@pytest.mark.parametrize("policy", ["on", "auto"])
@pytest.mark.parametrize(
    "name, loops", [("qwen3_next", True), ("qwen3_5", True), ("kimi_linear", True), ("llama", False), ("lfm2", False)]
)
def test_a_model_whose_gated_delta_layers_loop_prefills_eagerly_and_decodes_compiled(name, loops, policy):
    """On the CPU mlx-lm runs its gated delta update (qwen3_next, qwen3_5, kimi_linear) as an ops
    loop over the prompt's positions: their prefill and chunk steps run eagerly under every
    policy (auto does not time a compiled form), their decode step compiled; other models'
    steps (a plain attention, lfm2's short convolutions) all compile."""
    model = tiny_model(name)
    assert model.args.loops_prompts is loops
    executor = Executor(model, quiet_compile_cache(policy))
    for phase, batch, size, capacity in (("prefill", 2, 8, 0), ("chunk", 1, 8, 16), ("decode", 2, 16, 0)):
        compiled = executor.warm(phase, batch, size, capacity, repeats=1)
        if policy == "on":
            assert compiled is (phase == "decode" or not loops), (name, phase)
        elif loops and phase != "decode":  # auto: the other choices are timings, not asserted
            assert compiled is False, (name, phase)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("name", ["qwen3_next", "llama"])
def test_an_eager_prefill_runs_whole_prompts_at_their_own_shape_with_mlx_lms_tokens(name, gpu, monkeypatch):
    """Three prompts of 5, 11 and 3 tokens at once (prompt buckets 8 and 16, batch buckets 1, 2,
    4): qwen3_next's eager prefill (its gated delta loop, :attr:`Executor.exact_prefill`) runs
    the 5- and 3-token prompts as 2 rows of 5 tokens and the 11-token one as 1 row of 11, each
    call looked up and counted at its bucket; where the executor batches prompts as a GPU's does
    (``batches_chunks``) it runs all three as 3 rows of 11, one pass of the loop, counted at
    (4, 16). llama's compiled prefill pads them to (2, 8) and (1, 16) either way. All give
    mlx-lm's greedy tokens."""
    model = tiny_model(name)
    shapes: list[tuple[tuple[int, int], tuple[int, int] | None]] = []
    prefill = Executor.prefill

    def spy(self, tokens, lengths, bucket=None):
        shapes.append(((len(tokens), len(tokens[0])), bucket))
        return prefill(self, tokens, lengths, bucket)

    monkeypatch.setattr(Executor, "prefill", spy)
    requests = [(list(range(30, 35)), 6), (list(range(60, 71)), 5), ([7, 90, 11], 7)]
    engine = engine_at(model, BUCKETS)
    engine.executor.batches_chunks = gpu
    served = step_by_hand(engine, requests)
    for (prompt, max_tokens), got in zip(requests, served, strict=True):
        assert got.tokens == mlx_lm_tokens(model, prompt, max_tokens), (name, len(prompt))
    if name == "qwen3_next" and gpu:
        assert shapes == [((3, 11), (4, 16))], shapes
    elif name == "qwen3_next":
        assert sorted(shapes) == [((1, 11), (1, 16)), ((2, 5), (2, 8))], shapes
    else:
        assert sorted(shapes) == [((1, 16), None), ((2, 8), None)], shapes


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("name", ["qwen3_next", "llama"])
def test_an_eager_chunk_runs_its_real_tokens_with_mlx_lms_tokens(name, batched, monkeypatch):
    """Prompts of 21 and 19 tokens in chunks of 8 (prompt buckets 8 and 16): qwen3_next's eager
    chunk step runs each chunk's real tokens, its last ones 5 and 3 (together as 2 rows of 5
    where last chunks batch, as on a GPU: :meth:`Executor.chunk_rows`), each call looked up at
    its bucket T = 8; llama's compiled chunk step runs them padded to 8. Both give mlx-lm's
    greedy tokens."""
    model = tiny_model(name)
    calls: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    step_fn = Executor.step_fn

    def spy(self, phase, *bucket):
        fn = step_fn(self, phase, *bucket)
        if phase != "chunk":
            return fn

        def call(params, ids, at, real, kv):
            calls.append((bucket, tuple(ids.shape), max(real.tolist())))
            return fn(params, ids, at, real, kv)

        return call

    monkeypatch.setattr(Executor, "step_fn", spy)
    engine = engine_at(model, BUCKETS, prefill_chunk_tokens=8, max_batched_tokens=16)
    engine.executor.batches_chunks = batched
    requests = [(list(range(30, 51)), 5), (list(range(60, 79)), 5)]
    served = step_by_hand(engine, requests)
    for (prompt, max_tokens), got in zip(requests, served, strict=True):
        assert got.tokens == mlx_lm_tokens(model, prompt, max_tokens), (name, len(prompt))
    assert all(bucket[1] == 8 for bucket, _, _ in calls), calls
    if name == "qwen3_next":
        assert all(shape[1] == longest for _, shape, longest in calls), calls
        last = sorted(shape for _, shape, longest in calls if longest < 8)
        assert last == ([(2, 5)] if batched else [(1, 3), (1, 5)]), calls
    else:
        assert all(shape == bucket[:2] for bucket, shape, _ in calls), calls
        assert any(longest < 8 for _, _, longest in calls), calls


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next"])
def test_a_model_without_a_verify_step_decodes_plain(name):
    model = tiny_model(name)
    assert not model.args.can_verify
    engine = engine_at(model, BUCKETS, speculative="lookup")
    assert engine.speculator is None
    assert "verify" not in engine.executor._specs


def test_a_staging_cache_growing_past_a_sliding_window_stays_linear(tmp_path):
    """The hand-written Gemma 3 too: a prompt of three chunks grows its staging cache from 16 to
    32 positions past its window of 8; resized as a decode ring, the sliding layers shrank to 8
    under the next chunk's writes (out of bounds: the process crashed)."""
    reference = write_lm_dir(tmp_path / "g", tiny_config("gemma3_text"))
    model = load_model(tmp_path / "g", "g", mx.float32, "dequantized")
    assert isinstance(model.args, ModelArgs) and model.args.windows
    prompt = list(range(60, 80))
    served = step_by_hand(engine_at(model, BUCKETS, prefill_chunk_tokens=8, max_batched_tokens=16), [(prompt, 6)])
    expected = [int(t) for t, _ in generate_step(mx.array(prompt, mx.int32), reference, max_tokens=6)]
    assert served[0].tokens == expected


@pytest.mark.parametrize("name", ["qwen3_next", "llama"])
def test_the_memory_estimate_counts_a_recurrent_state_once_per_row(name):
    """A gated delta net's state is a row's whatever its length: the worst case counts it once
    per prefill row, not once per position (which sized a 0.26B Qwen3-Next-shaped model's
    prefill at tens of GB and its max_sequences at 2)."""
    model = tiny_model(name)
    assert isinstance(model.args, AdapterArgs)
    held = [model.args.allocate(1, n, mx.float32).nbytes for n in (16, 17)]
    assert kv_bytes_per_position(model) == held[1] - held[0]
    assert state_bytes_per_row(model) == held[0] - 16 * kv_bytes_per_position(model)
    assert (state_bytes_per_row(model) > 0) == (name == "qwen3_next")
    buckets = BucketTable((1, 2), (16, 32), (64,))
    scores = model.args.num_attention_heads * 16 * 16 * SCORES_BYTES
    assert prefill_bytes(model, buckets, 1, 16, 32, 64) == held[0] + scores  # one whole 16-token row


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "phi3"])
def test_mlx_lm_classes_decode_over_a_small_paged_pool_with_mlx_lms_tokens(name):
    """mlx-lm's own module decodes over the paged pool (each row's blocks gathered into a linear
    view, Gemma 3's window a mask there): mixed requests on a pool too small for all of them at
    once are preempted and resumed, and every request still gets mlx-lm's greedy tokens; once
    idle every block is free or cached."""
    model = tiny_model(name)
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    pool = {"kv_cache": "paged", "kv_block_tokens": 8, "kv_pool_tokens": 48, "prefix_cache_bytes": 10**6}
    engine = chunking_engine(model, metrics, **pool)
    assert engine.paged is not None
    served = step_by_hand(engine, MIXED)
    for (prompt, max_tokens), got in zip(MIXED, served, strict=True):
        expected = mlx_lm_tokens(model, prompt, max_tokens)
        assert got.tokens == expected, f"{name}, prompt of {len(prompt)}: got {got.tokens}, mlx-lm {expected}"
    assert metrics.registry.get_sample_value("stepserve_preemptions_total", {"model": name}), "nothing preempted"
    stats = engine.paged.blocks.stats()
    assert stats.used == 0 and stats.free + stats.cached == stats.total


def mlx_lm_quantized_tokens(model: LoadedModel, prompt: list[int], max_tokens: int, bits: int) -> list[int]:
    """mlx-lm's own greedy generation over its ``QuantizedKVCache``, as stepserve's pool keeps
    keys and values: the prompt prefilled at full precision (mlx-lm's ``KVCache``, every layer
    linear: a sliding layer's window is its mask), its caches then quantized (``to_quantized``,
    groups of 64), each generated token's keys and values quantized as they are written."""
    from mlx_lm.models.cache import KVCache as MlxLmKVCache

    assert isinstance(model.args, AdapterArgs)
    module = model.args.module
    caches = [MlxLmKVCache() for _ in module.layers]
    logits = module(mx.array([prompt], mx.int32), cache=caches)[0, -1]
    quantized = [c.to_quantized(group_size=64, bits=bits) for c in caches]
    tokens = [int(mx.argmax(logits).item())]
    while len(tokens) < max_tokens:
        tokens.append(int(mx.argmax(module(mx.array([[tokens[-1]]], mx.int32), cache=quantized)[0, -1]).item()))
    return tokens


BIG_POOL = {"kv_cache": "paged", "kv_block_tokens": 8, "kv_pool_tokens": 512}  # no preemption


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", ["llama", "gemma3_text", "phi3", "olmo2"])
def test_mlx_lm_classes_on_a_quantized_pool_give_mlx_lms_quantized_cache_tokens(name, bits):
    """``kv_bits``: concurrent requests of mixed lengths, prefilled in chunks at full precision
    and joined into a quantized pool (``Executor.write_blocks`` quantizes), decode to exactly
    the greedy tokens of mlx-lm's own ``QuantizedKVCache`` after a full-precision prefill."""
    model = tiny_model(name, **WIDE_HEADS)
    engine = chunking_engine(model, **BIG_POOL, kv_bits=bits)
    assert engine.executor.pool is not None and engine.executor.pool.quantized
    for (prompt, max_tokens), got in zip(MIXED, step_by_hand(engine, MIXED), strict=True):
        expected = mlx_lm_quantized_tokens(model, prompt, max_tokens, bits)
        assert got.tokens == expected, f"{name}, prompt of {len(prompt)}: got {got.tokens}, mlx-lm {expected}"


def test_prompt_lookup_on_a_quantized_pool_gives_mlx_lms_quantized_cache_tokens():
    """Verify steps over an 8-bit pool (:func:`models.adapter.verify_paged` with ``bits``):
    proposals are accepted and rejected (a rejected one's quantized keys stay masked in its
    row's block), and every request still gets the greedy tokens of mlx-lm's own
    ``QuantizedKVCache``, as decoding one token at a time does."""
    model = tiny_model("llama", **WIDE_HEADS)
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    speculating = {"speculative": "lookup", "speculative_tokens": 3, "speculative_max_batch": 4}
    engine = chunking_engine(model, metrics, **BIG_POOL, kv_bits=8, **speculating)
    assert "verify" in engine.executor._specs
    requests = [(prompt, 24) for prompt, _ in MIXED[:4]]
    for (prompt, max_tokens), got in zip(requests, step_by_hand(engine, requests), strict=True):
        assert got.tokens == mlx_lm_quantized_tokens(model, prompt, max_tokens, 8)
    labels = {"model": "llama", "method": "lookup"}
    proposed = metrics.registry.get_sample_value("stepserve_speculative_proposed_tokens_total", labels)
    accepted = metrics.registry.get_sample_value("stepserve_speculative_accepted_tokens_total", labels)
    assert proposed and accepted and accepted < proposed, (proposed, accepted)


@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_an_8_bit_pool_gives_the_unquantized_tokens_at_95_percent(name):
    """The bar set for the real default model (tests/e2e/test_kv_bits.py), free-running: the
    requests' tokens at each position equal those of an unquantized pool at >= 95% of
    positions. (A tiny random model's greedy choice is often a near-tie, and a departure
    changes the rest of its request: the tiny gemma3_text and olmo2 fall below the bar at 8
    bits, though every token is mlx-lm's own quantized cache's, as the test above checks.)"""
    model = tiny_model(name, **WIDE_HEADS)
    plain = step_by_hand(chunking_engine(model, **BIG_POOL), MIXED)
    quantized = step_by_hand(chunking_engine(model, **BIG_POOL, kv_bits=8), MIXED)
    pairs = [(a, b) for p, q in zip(plain, quantized, strict=True) for a, b in zip(p.tokens, q.tokens, strict=True)]
    assert len(pairs) == sum(n for _, n in MIXED)
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    assert agreement >= 0.95, f"{name}: {agreement:.1%} of tokens as an unquantized pool's"


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_a_preempting_quantized_pool_completes_every_request_and_leaks_no_block(name):
    """A pool of 6 blocks of 8 at 8 bits, too small for the requests at once: requests are
    preempted and resumed (a prefix hit reads its blocks dequantized into the staging cache),
    every request ends at its length without error, and once idle every block is free or
    cached."""
    model = tiny_model(name, **WIDE_HEADS)
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    pool = {"kv_cache": "paged", "kv_block_tokens": 8, "kv_pool_tokens": 48, "prefix_cache_bytes": 10**6}
    engine = chunking_engine(model, metrics, **pool, kv_bits=8)
    assert engine.paged is not None
    served = step_by_hand(engine, MIXED)
    assert [(len(s.tokens), s.final.error) for s in served] == [(n, None) for _, n in MIXED]
    assert metrics.registry.get_sample_value("stepserve_preemptions_total", {"model": name}), "nothing preempted"
    assert any(s.final.cached_tokens for s in served), "no resumed request hit its blocks"
    stats = engine.paged.blocks.stats()
    assert stats.used == 0 and stats.free + stats.cached == stats.total


def test_kv_bits_for_a_class_whose_attention_reads_the_keys_is_refused_naming_it():
    """mlx-lm's gemma2 computes its attention scores itself: over quantized keys it would get a
    tuple, so the engine refuses ``kv_bits`` for it at once, naming the model type and the fix."""
    with pytest.raises(ValueError, match=r"kv_bits = 8: gemma2's attention fails on quantized keys .*remove kv_bits"):
        engine_at(tiny_model("gemma2", **WIDE_HEADS), BUCKETS, **BIG_POOL, kv_bits=8)


def test_a_model_whose_caches_a_pool_cannot_hold_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"model type 'qwen3_next' here is neither \(set kv_cache = 'static'\)"):
        engine_at(tiny_model("qwen3_next"), BUCKETS, kv_cache="paged", kv_block_tokens=8, kv_pool_tokens=96)


def test_a_pool_written_by_the_warm_up_thread_serves_on_the_engine_thread():
    """The warm-up runs on a thread of its own and leaves the pool's last writes lazy; the
    engine thread must still read it (MLX streams are per thread: it failed with "There is no
    Stream(cpu, 1) in current thread" until the warm-up evaluated what it leaves behind)."""
    model = tiny_model("llama")
    engine = engine_at(model, BUCKETS, kv_cache="paged", kv_block_tokens=8, kv_pool_tokens=96, prefill_chunk_tokens=8)
    requests = MIXED[:3]
    for (prompt, max_tokens), got in zip(requests, serve(engine, requests), strict=True):
        assert got.tokens == mlx_lm_tokens(model, prompt, max_tokens)


def echoes(model: LoadedModel) -> list[tuple[list[int], int]]:
    """Greedy requests that quote themselves: each prompt is a start s (6 tokens of a
    :data:`MIXED` prompt), mlx-lm's 8 greedy tokens after s, then s again. Prompt lookup proposes
    the quote once the model's first token matches it, and the model follows the quote for a
    while, then departs from it (its context is longer now): proposals accepted and rejected.
    Each row holds up to 36 positions, so a pool of 48 cannot hold them all at once."""
    starts = [prompt[:6] for prompt, _ in MIXED]
    return [(s + mlx_lm_tokens(model, s, 8) + s, 16) for s in starts]


SMALL_POOL = {"kv_cache": "paged", "kv_block_tokens": 4, "kv_pool_tokens": 48, "prefix_cache_bytes": 10**6}
SPECULATING = {"speculative_tokens": 3, "speculative_max_batch": 4}


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "phi3"])
@pytest.mark.parametrize("method", ["lookup", "draft"])
def test_mlx_lm_classes_speculate_on_a_small_pool_with_mlx_lms_tokens(name, method):
    """mlx-lm's own module verifies over the paged pool (:func:`models.adapter.verify_paged`;
    Gemma 3's window a mask on the linear view): with prompt lookup, or a draft that is the model
    itself (on its own static cache), requests on a pool small enough to preempt get mlx-lm's
    greedy tokens; proposals are accepted (every one of the draft's: it drafts for itself; some of
    lookup's are rejected and rolled back), and once idle every block is free or cached."""
    # (the tiny random Gemma 3 departs from a quote at once, so lookup would propose nothing: damped,
    # its layers change the embedding's token less, and it follows quotes for a while)
    model = tiny_model(name, post_norms=0.15 if name == "gemma3_text" else None)
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    draft = None
    if method == "draft":
        draft = LoadedModel(
            f"{name}/draft", Path("-"), model.args, model.params, model.tokenizer, mx.float32, "dequantized", 0.0
        )
    engine = chunking_engine(model, metrics, draft=draft, speculative=method, **SPECULATING, **SMALL_POOL)
    assert engine.paged is not None and engine.speculator is not None and engine.executor.can_verify
    requests = echoes(model)
    served = step_by_hand(engine, requests)
    for (prompt, max_tokens), got in zip(requests, served, strict=True):
        expected = mlx_lm_tokens(model, prompt, max_tokens)
        assert got.tokens == expected, f"{name}, {method}, prompt of {len(prompt)}: got {got.tokens}, mlx-lm {expected}"
    labels = {"model": name, "method": method}
    proposed = metrics.registry.get_sample_value("stepserve_speculative_proposed_tokens_total", labels)
    accepted = metrics.registry.get_sample_value("stepserve_speculative_accepted_tokens_total", labels)
    assert proposed and accepted, (proposed, accepted)
    assert accepted == proposed if method == "draft" else accepted < proposed, (proposed, accepted)
    assert metrics.registry.get_sample_value("stepserve_preemptions_total", {"model": name}), "nothing preempted"
    stats = engine.paged.blocks.stats()
    assert stats.used == 0 and stats.free + stats.cached == stats.total


def test_a_draft_for_an_mlx_lm_class_loads_on_the_pool_and_is_refused_for_rings_on_the_static_cache(tmp_path):
    """At start-up: ``draft`` on the paged pool loads for mlx-lm's class (it verifies there,
    Gemma 3's sliding layers included); on the static cache mlx-lm's Gemma 3 class is refused,
    naming the pool as the fix."""
    from models.errors import ModelLoadError
    from service.config import load_settings
    from service.process.startup import load_models

    pool = {"kv_cache": "paged", "kv_block_tokens": 8, "kv_pool_tokens": 96}
    write_lm_dir(tmp_path / "g", tiny_config("gemma3_text"))
    drafted = {
        "model": str(tmp_path / "g"),
        "model_impl": "mlx_lm",
        "speculative": "draft",
        "draft_model": tmp_path / "g",
    }
    models = load_models(load_settings(**drafted, **pool))
    assert len(models) == 2 and isinstance(next(iter(models.values())).args, AdapterArgs)
    with pytest.raises(ModelLoadError, match=r"sliding-window layers on the static cache.*set kv_cache = 'paged'"):
        load_models(load_settings(**drafted))
