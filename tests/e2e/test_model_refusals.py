"""A model the server cannot compute exactly is refused at start-up: `stepserve serve` exits 2
with a message naming the file, the key and what is supported, before serving anything."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import STEPSERVE, tiny_config, write_dir, write_lm_dir

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
        ("gemma3_text", {"model_type": "gemma2"}, "model_type 'gemma2' is not supported; supported: gemma3_text"),
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
