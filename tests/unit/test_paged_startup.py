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
from tests.support import TINY, WordTokenizer, random_params


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


def test_kv_bits_without_the_paged_pool_is_refused_naming_the_fix():
    from service.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match="kv_bits = 8 .* set kv_cache = 'paged'"):
        load_settings(model_name="tiny", kv_bits=8)
    assert load_settings(model_name="tiny", kv_bits=8, kv_cache="paged").kv_bits == 8
    assert load_settings(model_name="tiny").kv_bits is None  # off by default
    with pytest.raises(ConfigError, match="kv_bits must be 4 or 8"):
        load_settings(model_name="tiny", kv_bits=6, kv_cache="paged")


def test_a_quantized_pool_holds_more_tokens_in_the_same_budget(model):
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
