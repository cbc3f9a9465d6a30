"""A model the server cannot compute exactly is refused at start-up: `stepserve serve` exits 2
with a message naming the file, the key and what is supported, before serving anything."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import STEPSERVE, write_dir

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "key,value",
    [("rope_scaling", LLAMA3_ROPE), ("final_logit_softcapping", 30.0), ("hidden_act", "gelu")],
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
