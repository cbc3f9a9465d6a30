"""Start-up with a paged KV pool: the pool gets what the budget leaves, ``max_sequences`` is a cap,
and a sequence may grow to the model's context (its capacity ladder extended by doubling), or to
the pool where the pool is smaller; a pool smaller than one bucket is refused, naming the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest

from models.loader import LoadedModel
from service.config import Settings
from service.process.memory import kv_bytes_per_position
from service.process.startup import MemoryBudgetError, check_memory, context_ladder
from tests.support import TINY, WIDE, WordTokenizer, random_params


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    params, tokenizer = random_params(seed=1), cast(Any, WordTokenizer(frozenset()))
    return LoadedModel("tiny", Path("-"), TINY, params, tokenizer, mx.float32, "dequantized", 0.0)


def settings(**keys) -> Settings:
    base = dict(model_name="tiny", kv_cache="paged", prefix_cache_bytes=0, batch_buckets=[1, 2, 4])
    return Settings(prompt_buckets=[16, 32], **{**base, **keys})


def test_context_ladder_doubles_to_the_limit_in_whole_blocks():
    assert context_ladder([256, 512, 8192], 45_330, 16) == [256, 512, 8192, 16384, 32768, 45328]
    assert context_ladder([256, 512, 8192], 600, 16) == [256, 512, 592]
    assert context_ladder([256, 512], 512, 16) == [256, 512]


def test_the_ladder_grows_to_the_models_context_when_the_pool_holds_it(model):
    resolved = check_memory(settings(memory_budget_bytes=10**9), {"tiny": model}).served_models()[0]
    assert resolved.capacity_buckets[-1] == TINY.max_position_embeddings  # 512
    assert resolved.max_sequences == 4  # the largest batch bucket: a cap, not a worst case


def test_max_model_len_and_set_buckets_bound_the_ladder(model):
    short = check_memory(settings(memory_budget_bytes=10**9, max_model_len=100), {"tiny": model})
    assert short.served_models()[0].capacity_buckets[-1] == 96  # whole blocks of 16
    chosen = check_memory(settings(memory_budget_bytes=10**9, capacity_buckets=[64, 128]), {"tiny": model})
    assert chosen.served_models()[0].capacity_buckets == [64, 128]


def test_a_pool_smaller_than_the_context_bounds_a_sequence_and_one_smaller_than_a_bucket_is_refused(model):
    per = kv_bytes_per_position(model)
    resolved = check_memory(settings(memory_budget_bytes=10**9, kv_pool_tokens=300), {"tiny": model})
    assert resolved.served_models()[0].capacity_buckets[-1] == 288 and resolved.kv_pool_tokens == 300
    with pytest.raises(MemoryBudgetError, match="kv_pool_tokens"):
        check_memory(settings(memory_budget_bytes=model.nbytes + 8 * per, capacity_buckets=[16, 32]), {"tiny": model})


def test_the_ladder_stops_where_its_prefill_step_leaves_a_pool_that_still_holds_one_sequence(model, monkeypatch):
    # A ladder up to the context (512) would need a prefill step that leaves a pool below the
    # smallest bucket (refused before); its top is now the longest sequence whose pool, beside
    # that sequence's prefill step, still holds it. The tiny model prefills in the pool's blocks:
    # its chunk step at capacity C holds float32 scores of C positions' bytes (4 heads x 32 x C)
    # and one layer's view of its blocks, C / 2 positions' (2 layers), so a budget of 800 positions
    # tops the ladder at 304 (pool 312); at 600 it tops at 227 positions, under the smallest
    # bucket. (The staging path's step counted the scores alone: its staging row was not counted.)
    # The figures are a process's that runs prompts' last chunks one by one (the CPU); a GPU
    # batches them, a larger step (it failed there, 2026-11-29, before this line).
    import service.process.memory as memory

    monkeypatch.setattr(memory, "batches_last_chunks", lambda: False)
    per, bt = kv_bytes_per_position(model), 16
    budget = model.nbytes + 800 * per
    resolved = check_memory(settings(memory_budget_bytes=budget), {"tiny": model})
    top, pool = resolved.served_models()[0].capacity_buckets[-1], resolved.kv_pool_tokens
    assert pool is not None and 256 <= top < TINY.max_position_embeddings and top % bt == 0 and pool >= top
    assert (top, pool) == (304, 312)
    for longer in (top + bt, TINY.max_position_embeddings):  # one block more no longer fits, nor the context
        try:
            pool_then = check_memory(
                settings(memory_budget_bytes=budget, capacity_buckets=[256, longer]), {"tiny": model}
            )
        except MemoryBudgetError:
            continue  # not even the smallest bucket beside that step
        assert (pool_then.kv_pool_tokens or 0) < longer


def test_kv_bits_without_the_paged_pool_is_refused_naming_the_fix():
    from service.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match="kv_bits = 8 .* set kv_cache = 'paged'"):
        load_settings(model_name="tiny", kv_bits=8)
    assert load_settings(model_name="tiny", kv_bits=8, kv_cache="paged").kv_bits == 8
    assert load_settings(model_name="tiny").kv_bits is None  # off by default
    with pytest.raises(ConfigError, match="kv_bits must be 4 or 8"):
        load_settings(model_name="tiny", kv_bits=6, kv_cache="paged")


def test_a_quantized_pool_holds_more_tokens_in_the_same_budget():
    model = wide_model("tiny")
    full = check_memory(settings(memory_budget_bytes=10**8), {"tiny": model}).kv_pool_tokens
    eight = check_memory(settings(memory_budget_bytes=10**8, kv_bits=8), {"tiny": model}).kv_pool_tokens
    four = check_memory(settings(memory_budget_bytes=10**8, kv_bits=4), {"tiny": model}).kv_pool_tokens
    assert full is not None and eight is not None and four is not None
    assert 3 * full < eight < 4 * full and 5 * full < four < 8 * full  # float32 against 8 and 4 bits


def test_prefix_cache_bytes_takes_nothing_from_the_pool_and_an_explicit_value_is_named(model, caplog):
    """With a paged pool the prefix cache is the pool's cached blocks: ``prefix_cache_bytes`` is
    not reserved beside the pool, and a value set explicitly gets a start-up warning saying so
    (0 only turns prefix caching off, and says nothing)."""
    budget = 10**8
    off = check_memory(settings(memory_budget_bytes=budget), {"tiny": model}).kv_pool_tokens
    assert not [r for r in caplog.records if "prefix_cache_bytes" in r.getMessage()]
    with caplog.at_level("WARNING", logger="stepserve"):
        on = check_memory(settings(memory_budget_bytes=budget, prefix_cache_bytes=budget // 2), {"tiny": model})
    assert on.kv_pool_tokens == off
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"prefix_cache_bytes = {budget // 2} does not apply with kv_cache = 'paged'" in m for m in warned)


def wide_model(name: str) -> LoadedModel:
    params, tokenizer = random_params(WIDE, seed=3), cast(Any, WordTokenizer(frozenset()))
    return LoadedModel(name, Path("-"), WIDE, params, tokenizer, mx.float32, "dequantized", 0.0)


def two_models(**keys) -> Settings:
    """Two [[models]] entries, "a" and "b", with a paged pool; ``a`` and ``b``: their own keys."""
    a, b = keys.pop("a", {}), keys.pop("b", {})
    return settings(models=[{"name": "a", **a}, {"name": "b", **b}], **keys)


def test_kv_bits_per_model_defaults_to_the_top_level_and_is_checked_naming_the_entry():
    from service.config import ConfigError, load_settings

    def bits(**keys) -> list[int | None]:
        models = [{"name": "a", **keys.pop("a", {})}, {"name": "b", **keys.pop("b", {})}]
        return [m.kv_bits for m in load_settings(models=models, kv_cache="paged", **keys).served_models()]

    assert bits(a={"kv_bits": 8}) == [8, None]
    assert bits(a={"kv_bits": 8}, b={"kv_bits": 4}) == [8, 4]
    assert bits(kv_bits=4, a={"kv_bits": 8}) == [8, 4]  # the top level is b's default
    with pytest.raises(ConfigError, match=r"models\[1\]\.kv_bits: kv_bits must be 4 or 8 \(got 6\)"):
        bits(b={"kv_bits": 6})
    static = [{"name": "a"}, {"name": "b", "kv_bits": 8}]
    with pytest.raises(ConfigError, match=r"models\[1\]\.kv_bits: model 'b' sets kv_bits = 8, .* kv_cache is 'auto'"):
        load_settings(models=static)


def test_a_head_dim_the_groups_do_not_divide_is_refused_naming_the_key(model):
    from models.errors import ModelLoadError

    models = {"a": wide_model("a"), "b": model}  # b: TINY, heads of 16
    with pytest.raises(ModelLoadError, match=r"model 'b': models\[1\]\.kv_bits = 8 .* head dim is 16"):
        check_memory(two_models(memory_budget_bytes=10**8, b={"kv_bits": 8}), models)
    with pytest.raises(ModelLoadError, match=r"model 'b': kv_bits \(top level\) = 4 .* remove the top-level kv_bits"):
        check_memory(two_models(memory_budget_bytes=10**8, kv_bits=4, a={"kv_bits": 8}), models)
    with pytest.raises(ModelLoadError, match=r"model 'tiny': kv_bits = 8 .* head dim is 16, .*; remove kv_bits$"):
        check_memory(settings(memory_budget_bytes=10**8, kv_bits=8), {"tiny": model})
    check_memory(two_models(memory_budget_bytes=10**8, a={"kv_bits": 8}), models)  # b unquantized: served


def test_two_models_get_pools_with_their_own_bits(caplog):
    from prometheus_client import CollectorRegistry

    from service.metrics import Metrics
    from service.process.build import build_engine

    models = {"a": wide_model("a"), "b": wide_model("b")}
    config = two_models(memory_budget_bytes=10**8, capacity_buckets=[64, 128], a={"kv_bits": 8}, b={"kv_bits": 4})
    with caplog.at_level("INFO", logger="stepserve"):
        resolved = check_memory(config, models)
    logged = [r.getMessage() for r in caplog.records if "paged KV pool" in r.getMessage()]
    assert any(m.startswith("model a:") and "kv_bits 8" in m for m in logged), logged
    assert any(m.startswith("model b:") and "kv_bits 4" in m for m in logged), logged
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    engines = {s.name: build_engine(resolved, s, models[s.name], metrics) for s in resolved.served_models()}
    assert {name: e.kv_summary()["kv_bits"] for name, e in engines.items()} == {"a": 8, "b": 4}  # /readyz's kv
    pools = {name: e.executor.pool for name, e in engines.items()}
    packed = {name: p.keys[0][0].shape[-1] for name, p in pools.items() if p is not None}  # uint32 words per head
    assert packed == {"a": WIDE.dim_per_head * 8 // 32, "b": WIDE.dim_per_head * 4 // 32}


def test_each_model_gets_a_pool_of_its_own_size():
    """A pool holds its own model's share: a 4-bit pool more tokens than an 8-bit one in the same
    bytes, and a model's kv_pool_tokens is its pool as given, the others splitting the rest."""
    from service.config import ConfigError, load_settings
    from service.process.memory import pool_bytes_per_position

    models = {"a": wide_model("a"), "b": wide_model("b")}
    budget = dict(memory_budget_bytes=10**8, capacity_buckets=[64, 128])
    shares = check_memory(two_models(**budget, a={"kv_bits": 8}, b={"kv_bits": 4}), models).served_models()
    per = {s.name: pool_bytes_per_position(models[s.name], s.kv_bits) for s in shares}
    tokens = {s.name: s.kv_pool_tokens for s in shares}
    assert tokens["b"] > tokens["a"] and abs(tokens["a"] * per["a"] - tokens["b"] * per["b"]) <= per["a"] + per["b"]
    fixed = check_memory(two_models(**budget, a={"kv_pool_tokens": 512}), models).served_models()
    plain = check_memory(two_models(**budget), models).served_models()
    assert fixed[0].kv_pool_tokens == 512 and plain[0].kv_pool_tokens == plain[1].kv_pool_tokens
    assert fixed[1].kv_pool_tokens > plain[1].kv_pool_tokens  # b takes what a leaves
    both = check_memory(two_models(**budget, kv_pool_tokens=256, b={"kv_pool_tokens": 1024}), models)
    assert [s.kv_pool_tokens for s in both.served_models()] == [256, 1024]  # the top level is a's default
    with pytest.raises(ConfigError, match=r"models\[0\]\.kv_pool_tokens: model 'a' sizes a paged KV pool"):
        load_settings(models=[{"name": "a", "kv_pool_tokens": 512}])


@pytest.mark.parametrize("gpu", [False, True])
def test_an_8b_model_under_a_16_gb_budget_holds_a_32k_prompt(gpu, monkeypatch):
    """Llama 3.1 8B's shape, 4.15 GB of 4-bit weights, ``memory_budget_bytes`` 16e9 (a 24 GB
    Mac's): the pool beside the largest prefill step holds one 32,000-token prompt, on a
    process that batches prompts' last chunks (a GPU) or not. Before, the ladder went to the
    context (131,072) and its prefill step left no pool at all: start-up was refused.

    The model prefills in the pool's blocks, so its largest step (a 512-token chunk at capacity
    C) holds no staging cache: 32 heads x 512 x C float32 scores, one layer's view of its blocks
    (C x 4 KB) and the chunk's keys and values. The ladder's top is then 58,704 with a pool of
    58,709 tokens (7.7 GB), on a GPU as on a CPU. With a staging cache the GPU's step counted a
    copy of its staging row (C x 131 KB, as a batch of last chunks copies it): top 36,160, pool
    36,168; the CPU's counted the scores alone (top 59,920, pool 59,936), not the staging row
    it held."""
    import service.process.memory as memory

    monkeypatch.setattr(memory, "batches_last_chunks", lambda: gpu)
    l8b = llama_8b_shape()
    resolved = check_memory(Settings(model_name="l8b", kv_cache="paged", memory_budget_bytes=16 * 10**9), {"l8b": l8b})
    top, pool = resolved.served_models()[0].capacity_buckets[-1], resolved.kv_pool_tokens
    assert pool is not None and 32_000 <= top <= pool
    assert (top, pool) == (58_704, 58_709)


def test_the_memory_budget_becomes_mlxs_memory_limit():
    """``memory_budget_bytes`` is also MLX's memory limit (its evaluation then waits for running
    work rather than queue past it), unless ``mlx_memory_limit_bytes`` is set or MLX's own limit
    is already lower; with neither key MLX's default stays."""
    from service.process.startup import apply_memory_limit

    before = mx.get_memory_limit()
    try:
        assert apply_memory_limit(Settings(model_name="tiny")) is None and mx.get_memory_limit() == before
        assert apply_memory_limit(Settings(model_name="tiny", memory_budget_bytes=before // 2)) == before // 2
        assert mx.get_memory_limit() == before // 2
        mx.set_memory_limit(before)
        assert apply_memory_limit(Settings(model_name="tiny", memory_budget_bytes=before * 2)) is None
        assert mx.get_memory_limit() == before
        both = Settings(model_name="tiny", memory_budget_bytes=10**9, mlx_memory_limit_bytes=2 * 10**9)
        assert apply_memory_limit(both) == 2 * 10**9 and mx.get_memory_limit() == 2 * 10**9
    finally:
        mx.set_memory_limit(before)


def llama_8b_shape() -> LoadedModel:
    """Llama 3.1 8B's shape with 4.15 GB of (lazy, never evaluated) 4-bit-sized weights."""
    from models.model_args import ModelArgs

    shape = ModelArgs(
        hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
    )  # fmt: skip
    weights = {"w": mx.zeros((4_150_000_000 // 2,), mx.float16)}  # lazy: only its size is read
    return LoadedModel("l8b", Path("-"), shape, weights, cast(Any, WordTokenizer(frozenset())), mx.float16, "q", 0.0)


def test_an_8b_models_kv_bits_8_pool_holds_1_8_times_the_tokens_at_one_context():
    """``kv_bits 8`` on a float16 pool keeps 136 bytes per head and position (128 packed, two
    float16 scales and biases for D = 128 in groups of 64) against 256: 0.53 of the bytes. It
    prefills in its blocks too, so under the same budget and ``max_model_len`` (32,768: the same
    ladder, the same prefill step) the pool holds 1.88x the tokens (136,448 against 72,488). With
    the ladder left to the model's context, the longer ladder's prefill step (its float32 scores
    grow with the capacity) takes part of the gain: 84,608 tokens against 58,709 (1.44x)."""

    def sized(**keys) -> tuple[int, int]:
        config = Settings(model_name="l8b", kv_cache="paged", memory_budget_bytes=16 * 10**9, **keys)
        resolved = check_memory(config, {"l8b": llama_8b_shape()})
        pool = resolved.kv_pool_tokens
        assert pool is not None
        return resolved.served_models()[0].capacity_buckets[-1], pool

    assert sized(max_model_len=32768) == (32768, 72_488)
    assert sized(max_model_len=32768, kv_bits=8) == (32768, 136_448)
    assert sized(kv_bits=8) == (84_608, 84_608)


@pytest.mark.parametrize("policy", ["on", "auto"])
def test_warming_a_paged_step_writes_the_pool_in_place(model, policy):
    """A bucket's first call is evaluated inside the compile cache (its compile is timed); the
    warm-up hands it the pool alone, so the step's scatters write the pool in place. Before, the
    executor still held the pool during that evaluation and every layer's pool was copied: twice
    the pool at once, which ran an 8B model's GPU out of memory with a pool sized from MLX's own
    limit (docs/BENCHMARKS.md, "The paged decode attention kernel"). Under ``--compile auto``
    the warm-up times each bucket compiled and eager, several calls: each hands the pool on."""
    from service.engine.compile_cache import CompileCache
    from service.engine.executor import Executor

    executor = Executor(model, CompileCache(policy, lambda *a: None, lambda s: None))
    pool = executor.use_paged(4000, 16)
    size = pool.nbytes
    del pool
    for phase, batch, bucket in (("decode", 4, 256), ("decode", 2, 512)):
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        executor.warm(phase, batch, bucket)
        assert mx.get_peak_memory() - base < size / 4, (phase, batch, bucket, mx.get_peak_memory() - base, size)
        assert executor.pool is not None and executor.pool.nbytes == size


def test_kv_cache_auto_pages_on_a_gpu_and_is_static_on_the_cpu_or_for_a_model_that_cannot_page(model, tmp_path, caplog):
    """The default, ``kv_cache = 'auto'``: the paged pool on a GPU when every model served from
    start-up pages; static on the CPU, for a model with recurrent state (Qwen3-Next's), beside an
    on-demand model or with a draft model, the log naming why. An explicit value stays."""
    from models.loader import load_model
    from service.process.startup import resolve_kv_cache
    from tests.parity.tiny_configs import TINY_CONFIGS
    from tests.support import write_mlx_lm_dir

    auto = Settings(model_name="tiny", prefix_cache_bytes=0, batch_buckets=[1, 2, 4], prompt_buckets=[16, 32])
    assert auto.kv_cache == "auto"
    caplog.set_level("INFO", logger="stepserve")
    assert resolve_kv_cache(auto, {"tiny": model}, "gpu").kv_cache == "paged"
    assert "kv_cache = 'auto': paged (a GPU, and every model pages)" in caplog.text
    assert resolve_kv_cache(auto, {"tiny": model}, "cpu").kv_cache == "static"
    assert "kv_cache = 'auto': static (on the CPU)" in caplog.text
    assert check_memory(auto, {"tiny": model}).kv_cache == (
        "paged" if mx.default_device().type == mx.DeviceType.gpu else "static"
    )

    write_mlx_lm_dir(tmp_path / "qn", TINY_CONFIGS["qwen3_next"])
    qn = load_model(tmp_path / "qn", "qn", mx.float32)
    assert resolve_kv_cache(Settings(model_name="qn"), {"qn": qn}, "gpu").kv_cache == "static"
    assert "static (model 'qn' (qwen3_next) cannot page)" in caplog.text

    both = Settings.model_validate({"models": [{"name": "tiny"}, {"name": "b", "load": "on_demand"}]})
    assert resolve_kv_cache(both, {"tiny": model}, "gpu").kv_cache == "static"
    assert "static (model 'b' loads on demand)" in caplog.text
    drafted = Settings(model_name="tiny", speculative="draft", draft_model=tmp_path / "draft")
    assert resolve_kv_cache(drafted, {"tiny": model}, "gpu").kv_cache == "static"
    assert "static (model 'tiny' has a draft model)" in caplog.text
    assert resolve_kv_cache(auto, {"tiny": model}, "gpu", group=True).kv_cache == "static"
    assert "static (a pipeline group, which pages only with kv_cache = 'paged')" in caplog.text
    for explicit in ("static", "paged"):
        for device in ("cpu", "gpu"):
            assert (
                resolve_kv_cache(Settings(model_name="tiny", kv_cache=explicit), {"tiny": model}, device).kv_cache
                == explicit
            )


def test_a_pool_sized_from_mlxs_own_limit_holds_at_most_every_row_at_the_ladders_top(model, monkeypatch):
    """With no budget set the pool is sized from MLX's limit (most of a GPU's memory), and taken
    only up to what ``max_sequences`` rows at the ladder's top can hold: a small model does not
    claim the device for prefix caching. A budget that is set is used whole."""
    monkeypatch.setattr(mx, "get_memory_limit", lambda: 10**9)
    unset = check_memory(settings(), {"tiny": model})
    spec = unset.served_models()[0]
    assert (spec.max_sequences, spec.capacity_buckets[-1]) == (4, 512)
    assert unset.kv_pool_tokens == 4 * 512
    given = check_memory(settings(memory_budget_bytes=10**9), {"tiny": model}).kv_pool_tokens
    assert given is not None and given > 4 * 512
    rows = check_memory(settings(max_sequences=2), {"tiny": model}).kv_pool_tokens
    assert rows == 2 * 512


def test_compile_auto_on_the_pool_warms_chooses_and_answers_as_compiled_steps(model):
    """``--compile auto`` on a paged pool: the warm-up times every bucket compiled and eager on
    the pool itself, handing it on from call to call, and keeps one form per bucket; requests
    after ready miss no step, get the greedy tokens of an engine compiled throughout, and leave
    every block free."""
    from prometheus_client import CollectorRegistry

    from service.engine.buckets import BucketTable
    from service.engine.sequence import SamplingParams, Sequence
    from service.engine.warmup import WarmupSpec
    from service.metrics import Metrics
    from tests.support import engine_at, serve_all, start_engine

    buckets = BucketTable(batch=(1, 2), prompt=(8, 16), capacity=(32, 64))
    answers = {}
    for policy in ("on", "auto"):
        misses: list[tuple] = []
        metrics = Metrics(CollectorRegistry(), version="t", device="cpu")
        metrics.record_lookup = lambda m, p, b, hit, misses=misses: None if hit else misses.append((m, p, b))  # type: ignore[method-assign]
        engine = engine_at(
            model, buckets, metrics, compile=policy, kv_cache="paged", kv_block_tokens=16, kv_pool_tokens=512,
            prefill_chunk_tokens=8,
        )  # fmt: skip
        start_engine(engine, WarmupSpec(prompt_tokens=16, batch=2, chunk_tokens=8, max_batched_tokens=16))
        try:
            assert engine.ready.wait(120)
            choices = engine.compile_choices()
            assert any(k.startswith("decode b2") for k in choices), choices
            before = len(misses)
            seqs = [
                Sequence(
                    [3 + i, 5, 7, 11, 13, 2, 4][: 5 + i],
                    SamplingParams(max_tokens=12, ignore_eos=True),
                    model.tokenizer.detokenizer(),
                    lambda event: None,
                )
                for i in range(2)
            ]
            serve_all(engine, seqs)
            assert all(s.finish_reason == "length" for s in seqs)
            assert misses[before:] == []
            assert engine.paged is not None and engine.paged.blocks.stats().used == 0
            answers[policy] = [list(s.output_ids) for s in seqs]
        finally:
            engine.stop()
    assert answers["auto"] == answers["on"] and all(len(a) == 12 for a in answers["on"])


def test_lookup_on_a_model_only_the_pool_verifies_logs_what_auto_may_still_choose(tmp_path, caplog):
    """Gemma 3's sliding-window layers verify on the pool, not on the static cache. Loaded for
    the static cache, ``--speculative lookup`` names the fix; loaded under ``kv_cache = 'auto'``
    (resolved after loading) the log says the pool, if chosen, speculates; for the pool, no
    such line."""
    from service.process.startup import load_served
    from tests.support import tiny_config, write_lm_dir

    write_lm_dir(tmp_path / "g", tiny_config("gemma3_text"))
    spec = Settings(model_name="g", model=tmp_path / "g", speculative="lookup").served_models()[0]
    caplog.set_level("INFO", logger="stepserve")
    lines = {}
    for paged in (False, None, True):
        caplog.clear()
        load_served(spec, paged=paged)
        lines[paged] = [r.getMessage() for r in caplog.records if "without speculation" in r.getMessage()]
    assert len(lines[False]) == 1 and lines[False][0].endswith("unless kv_cache = 'paged'")
    assert len(lines[None]) == 1 and "kv_cache = 'auto': the paged pool, where it speculates" in lines[None][0]
    assert lines[True] == [], lines
