"""Several models from one TOML file: settings inheritance and the start-up memory estimate (no server)."""

from pathlib import Path

import mlx.core as mx
import pytest

from models.loader import LoadedModel
from service.config import ConfigError, load_settings
from service.engine.buckets import BucketTable
from service.process.memory import prefill_bytes, worst_case
from tests.support import TINY, random_params, write_config


def test_models_inherit_top_level_settings(tmp_path, converted):
    settings = load_settings(write_config(tmp_path, converted))
    gguf, mlx_dir = settings.served_models()
    assert (gguf.name, gguf.compile, gguf.warmup_prompt_tokens, gguf.capacity_buckets) == (
        "smol-gguf",
        "on",
        64,
        [256, 512],
    )
    assert (mlx_dir.compile, mlx_dir.max_sequences, mlx_dir.path) == ("off", 1, converted)
    assert [m.name for m in load_settings().served_models()] == ["SmolLM2-135M-Instruct"]


def test_a_model_path_without_model_name_is_served_under_its_own_name(tmp_path):
    """A directory by its name, a GGUF file by its stem, a repo id as written less its revision;
    model_name wins; the default model keeps its name."""
    directory, gguf = tmp_path / "Llama-3.1-8B-4bit", tmp_path / "Llama-3.2-1B-Instruct-Q4_K_M.gguf"
    directory.mkdir()
    gguf.write_bytes(b"GGUF")

    def served_name(**values) -> str:
        return load_settings(**values).served_models()[0].name

    assert served_name(model=directory) == load_settings(model=directory).model_name == "Llama-3.1-8B-4bit"
    assert served_name(model=f"{directory}/") == "Llama-3.1-8B-4bit"
    assert served_name(model=gguf) == "Llama-3.2-1B-Instruct-Q4_K_M"
    assert served_name(model="mlx-community/Qwen3-0.6B-4bit") == "mlx-community/Qwen3-0.6B-4bit"
    assert served_name(model="hf.co/bartowski/X-GGUF@main:Q4_K_M") == "bartowski/X-GGUF:Q4_K_M"
    assert served_name(model=directory, model_name="llama") == "llama"
    assert served_name() == "SmolLM2-135M-Instruct"


def test_duplicate_model_names_are_refused(tmp_path):
    config = tmp_path / "dup.toml"
    config.write_text('[[models]]\nname = "a"\n[[models]]\nname = "a"\n')
    with pytest.raises(ConfigError, match="two models are named 'a'"):
        load_settings(config)


def test_memory_estimate_counts_weights_and_the_largest_caches():
    model = LoadedModel("tiny", Path("-"), TINY, random_params(), None, mx.float32, "dequantized", 0.0)
    buckets = BucketTable((1, 4), (32,), (256, 1024))
    est = worst_case(model, buckets, max_running=3, chunk_tokens=32, max_batched_tokens=64, prefix_cache_bytes=1000)
    per_position = 2 * TINY.num_hidden_layers * TINY.num_key_value_heads * TINY.dim_per_head * 4
    heads = TINY.num_attention_heads
    whole = 1 * 32 * (per_position + heads * 32 * 4)  # one 32-token prompt per call (a chunk of 32 tokens)
    chunk = 32 * per_position + heads * 32 * 1024 * 4  # one 32-token chunk's scores against a 1024 cache
    assert est.decode_cache == 4 * 1024 * per_position and est.prefill == max(whole, chunk)
    assert est.total == model.nbytes + 2 * est.decode_cache + est.prefill + 1000


def test_memory_estimate_counts_the_last_chunks_run_together():
    """Where prompts' last chunks run in one call (a GPU), the largest prefill step is that call:
    a copy of its rows' staging caches (padded to the batch bucket) and their scores."""
    model = LoadedModel("tiny", Path("-"), TINY, random_params(), None, mx.float32, "dequantized", 0.0)
    buckets = BucketTable((1, 4), (32,), (256, 1024))
    per_position = 2 * TINY.num_hidden_layers * TINY.num_key_value_heads * TINY.dim_per_head * 4
    heads = TINY.num_attention_heads
    alone = prefill_bytes(model, buckets, 3, 1024, 32, 128)
    together = prefill_bytes(model, buckets, 3, 1024, 32, 128, batched=True)
    assert alone == 32 * per_position + heads * 32 * 1024 * 4
    assert together == 4 * (1024 * per_position + heads * 32 * 1024 * 4)  # 4 rows of 32 fit 128 tokens
    assert prefill_bytes(model, buckets, 1, 1024, 32, 128, batched=True) == 1024 * per_position + heads * 32 * 1024 * 4
