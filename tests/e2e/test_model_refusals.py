"""A model the server cannot compute exactly, or whose caches the paged KV pool cannot hold, is
refused at start-up: `stepserve serve` exits 2 with a message naming the file or setting, the key
and what is supported, before serving anything; a model that serves free text but whose
tokenizer the grammar engine cannot read refuses structured output alone."""

from __future__ import annotations

import subprocess

import pytest

from tests.parity.tiny_configs import TINY_CONFIGS
from tests.support import STEPSERVE, ServerProcess, tiny_config, write_dir, write_lm_dir, write_mlx_lm_dir

DYNAMIC_ROPE = {"rope_type": "dynamic", "factor": 2.0}  # NTK scaling that depends on the length: not implemented


@pytest.mark.parametrize(
    "key,value",
    [("rope_scaling", DYNAMIC_ROPE), ("final_logit_softcapping", 30.0), ("hidden_act", "gelu")],
)
def test_unimplemented_config_key_fails_start_up_with_exit_2(tmp_path, key, value):
    write_dir(tmp_path / "model", **{key: value})
    result = subprocess.run(
        [STEPSERVE, "serve", "--model", str(tmp_path / "model"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert key in result.stderr and "config.json" in result.stderr and "supported" in result.stderr


@pytest.mark.parametrize(
    "model_type,keys,named",
    [
        ("gemma3_text", {"model_type": "gemma_x"}, "model_type 'gemma_x' is not supported: mlx-lm has no module"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not implemented"),
        ("qwen3_moe", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling="),
    ],
)
def test_unknown_model_types_and_other_architectures_keys_fail_start_up(tmp_path, model_type, keys, named):
    write_lm_dir(tmp_path / "model", tiny_config(model_type, **keys), reference=tiny_config(model_type))
    result = subprocess.run(
        [STEPSERVE, "serve", "--model", str(tmp_path / "model"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and "config.json" in result.stderr


def test_a_model_the_paged_pool_cannot_hold_is_refused_at_start_up_in_one_process(tmp_path):
    """DeepSeek-V3's latent attention (mlx-lm's class) keeps keys wider than values, which no
    pool block holds: with kv_cache = 'paged' one process refuses it at start-up as every rank of
    a pipeline group does (exit 2), naming the model, kv_cache, why and the fix."""
    directory = tmp_path / "deepseek_v3"
    write_mlx_lm_dir(directory, {**TINY_CONFIGS["deepseek_v3"], "num_hidden_layers": 3}, seed=1)
    result = subprocess.run(
        [STEPSERVE, "serve", "--model", str(directory), "--kv-cache", "paged", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    named = "model 'deepseek_v3': kv_cache = 'paged' cannot hold the caches of model_type 'deepseek_v3' (its keys are"
    assert named in result.stderr and "set kv_cache = 'static'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_tokenizer_the_grammar_engine_cannot_read_serves_free_text_and_refuses_structured_output(tmp_path):
    """Not every tokenizer.json has a decoder llguidance reads (a WordLevel vocabulary without
    one): the model still becomes ready and serves free text; a structured request gets 400
    naming response_format, and the log says why, instead of the server dying at warm-up."""
    write_dir(tmp_path / "model")  # a WordLevel tokenizer with no decoder
    (tmp_path / "model" / "tokenizer_config.json").write_text(
        '{"chat_template": "{% for m in messages %}{{ m.content }} {% endfor %}"}'
    )
    proc = ServerProcess.start(
        ["--model", str(tmp_path / "model"), "--warmup-prompt-tokens", "16", "--warmup-batch", "1"]
    )
    try:
        proc.wait_ready()
        messages = [{"role": "user", "content": "t3 t4 t5"}]
        with proc.client() as client:
            name = client.get("/v1/models").json()["data"][0]["id"]
            free = client.post("/infer", json={"model": name, "prompt": "t3 t4 t5", "max_tokens": 4})
            structured = client.post(
                "/v1/chat/completions",
                json={"model": name, "messages": messages, "max_tokens": 4, "response_format": {"type": "json_object"}},
            )
        assert name == "model"  # --model's directory name (no --model-name)
        assert free.status_code == 200 and free.json()["usage"]["completion_tokens"] >= 1
        assert structured.status_code == 400, structured.text
        assert "response_format" in structured.text and "cannot read this model's tokenizer" in structured.text
        assert "structured outputs and forced tool calls are unavailable" in proc.log()
    finally:
        proc.stop()
