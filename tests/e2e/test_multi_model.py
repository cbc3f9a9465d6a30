"""Several models from one TOML file served by a real server, routed by `model`, and the memory budget at start-up."""

import subprocess

import pytest

from tests.support import STEPSERVE, ServerProcess, write_config


@pytest.mark.parametrize("setting", ["memory_budget_bytes", "mlx_memory_limit_bytes"])
def test_over_the_memory_budget_refuses_to_start(tmp_path, converted, setting):
    config = write_config(tmp_path, converted, f"{setting} = 100000000")
    result = subprocess.run(
        [STEPSERVE, "serve", "--config", config, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert f"over {setting} 0.10 GB" in result.stderr and "model 'smol-gguf'" in result.stderr


def test_two_models_served_and_routed_by_name(tmp_path, converted):
    # No warm-up rehearsal (about half of the start here): routing, not the first request's speed, is tested.
    server = ServerProcess.start(["--config", write_config(tmp_path, converted, "warmup_rehearsal = false")])
    try:
        server.wait_ready()
        with server.client() as client:
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["smol-gguf", "smol-mlx"]
            chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16}
            default = client.post("/infer", json=chat).json()
            gguf = client.post("/infer", json={**chat, "model": "smol-gguf"}).json()
            converted_reply = client.post("/infer", json={**chat, "model": "smol-mlx"}).json()
            ready = client.get("/readyz").json()["models"]
        assert default["model"] == gguf["model"] == "smol-gguf" and converted_reply["model"] == "smol-mlx"
        assert "Paris" in gguf["text"] and converted_reply["text"] == gguf["text"]
        assert ready["smol-gguf"]["compile"] == "on" and ready["smol-mlx"]["compile"] == "off"
        assert server.metric("stepserve_compile_cache_misses_total", model="smol-mlx", phase="decode") > 0
    finally:
        server.stop()
