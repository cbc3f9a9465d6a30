"""Models named by Hugging Face repo id and loaded on demand, on a real server: a repo id found
offline (``HF_HUB_OFFLINE=1``) in a Hugging Face cache laid out as the hub lays it out, a GGUF
file of a repo of them named by its quantization (``ORG/NAME:Q4_1``, the real default model's
GGUF) and an ambiguous one refused, a repo id missing offline refused at start-up, and
on-demand models loaded by their first request (which waits, or is answered 503 with
Retry-After) and unloaded after ``ttl_s`` idle, each state shown by ``GET /v1/models``, the
metrics and the log."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from models.default import default_model_path
from tests.support import STEPSERVE, ServerProcess, hub_cache_repo, write_served_dir

REPO = "stepserve-test/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"
SMALL = "batch_buckets = [1, 2]\nprompt_buckets = [32]\ncapacity_buckets = [64, 128]\n"
CHAT = {"messages": [{"role": "user", "content": "t3 t4 t5"}], "max_tokens": 4}
UNLOAD_DEADLINE_S = 120  # a bound on a slow host, not a measurement


def hub_cache(root: Path) -> Path:
    """A Hugging Face hub cache holding :data:`REPO` at :data:`REVISION` (``models--ORG--NAME/
    snapshots/REV/`` with a tiny model directory, ``refs/main`` naming the revision)."""
    repo = root / f"models--{REPO.replace('/', '--')}"
    (repo / "snapshots").mkdir(parents=True)
    write_served_dir(repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return root


def offline_env(home: Path, cache: Path) -> dict[str, str]:
    return {"HF_HOME": str(home), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("on-demand")
    cache = hub_cache(root / "hub")
    config = root / "stepserve.toml"
    config.write_text(
        f"warmup_prompt_tokens = 32\nwarmup_batch = 1\nprefix_cache_bytes = 0\n{SMALL}"
        f'[[models]]\nname = "hub"\npath = "{REPO}"\n'
        f'[[models]]\nname = "lazy"\npath = "{REPO}"\nload = "on_demand"\nttl_s = 3\n'
        f'[[models]]\nname = "lazy-503"\npath = "{REPO}"\nload = "on_demand"\non_demand_wait = "503"\n'
    )
    proc = ServerProcess.start(["--config", str(config)], env=offline_env(root, cache))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def states(client) -> dict[str, str]:
    return {m["id"]: m["state"] for m in client.get("/v1/models").json()["data"]}


def wait_for_state(client, model: str, state: str) -> list[str]:
    """Poll ``GET /v1/models`` until ``model`` is in ``state``; returns the states seen on the way."""
    seen: list[str] = []
    deadline = time.monotonic() + UNLOAD_DEADLINE_S
    while time.monotonic() < deadline:
        now = states(client)[model]
        if not seen or seen[-1] != now:
            seen.append(now)
        if now == state:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"model {model} never reached state {state}; seen {seen}")


def wait_for_metric(server, name: str, value: float, **labels) -> None:
    """Poll ``/metrics`` until the metric reads ``value``."""
    deadline = time.monotonic() + UNLOAD_DEADLINE_S
    while server.metric(name, **labels) != value:
        assert time.monotonic() < deadline, f"{name}{labels} never reached {value}"
        time.sleep(0.05)


def test_repo_id_served_from_the_offline_cache(server):
    with server.client() as client:
        assert states(client) == {"hub": "loaded", "lazy": "unloaded", "lazy-503": "unloaded"}
        reply = client.post("/infer", json={**CHAT, "model": "hub"})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
    assert f"model hub: {REPO} (" in server.log() and f"models--stepserve-test--tiny-llama/snapshots/{REVISION}" in (
        server.log()
    )


def test_on_demand_model_loads_on_first_request_and_unloads_after_ttl(server):
    with server.client() as client:
        first = client.post("/infer", json={**CHAT, "model": "lazy"})  # waits for the load and warm-up
        assert first.status_code == 200 and first.json()["model"] == "lazy"
        assert states(client)["lazy"] == "loaded"
        assert server.metric("stepserve_model_loads_total", model="lazy", outcome="loaded") == 1
        assert server.metric("stepserve_model_state", model="lazy", state="loaded") == 1
        held = server.metric("stepserve_mlx_active_memory_bytes")
        seen = wait_for_state(client, "lazy", "unloaded")
        assert seen[0] == "loaded"
        wait_for_metric(server, "stepserve_model_unloads_total", 1, model="lazy")
        assert server.metric("stepserve_model_state", model="lazy", state="unloaded") == 1
        assert server.metric("stepserve_mlx_active_memory_bytes") < held  # its weights and caches are freed
        again = client.post("/infer", json={**CHAT, "model": "lazy"})  # loaded again
        assert again.status_code == 200 and again.json()["text"] == first.json()["text"]
    log = server.log()
    assert "model lazy: loading on demand" in log and "model lazy: loaded on demand" in log
    assert "model lazy: unloaded after" in log
    assert server.metric("stepserve_model_loads_total", model="lazy", outcome="loaded") == 2


def test_on_demand_model_answers_503_with_retry_after_while_loading(server):
    with server.client() as client:
        refused = client.post("/v1/chat/completions", json={**CHAT, "model": "lazy-503"})
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
        assert "loading" in refused.json()["error"]["message"]  # answered so only while it loads
        # A tiny model loads within a fraction of a second: /v1/models may already say loaded.
        assert wait_for_state(client, "lazy-503", "loaded") in (["loading", "loaded"], ["loaded"])
        served = client.post("/v1/chat/completions", json={**CHAT, "model": "lazy-503"})
        assert client.get("/readyz").status_code == 200
    assert served.status_code == 200 and served.json()["model"] == "lazy-503"


@pytest.mark.parametrize("entry", ["--model", "[[models]] load = 'on_demand'"])
def test_missing_repo_id_offline_refuses_to_start(tmp_path, entry):
    missing = "nobody-here/no-such-model"
    args = ["--model", missing]
    if entry != "--model":
        config = tmp_path / "stepserve.toml"
        config.write_text(f'[[models]]\nname = "missing"\npath = "{missing}"\nload = "on_demand"\n')
        args = ["--config", str(config)]
    result = subprocess.run(
        [STEPSERVE, "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **offline_env(tmp_path, tmp_path / "hub")},
    )
    assert result.returncode == 2, result.stderr
    assert f"model '{missing}'" in result.stderr and "HF_HUB_OFFLINE=1" in result.stderr


GGUF_REPO = "stepserve-test/SmolLM2-135M-Instruct-GGUF"


def test_a_gguf_repo_serves_the_quantization_named_and_refuses_an_ambiguous_one(tmp_path):
    gguf = default_model_path()
    files = {"SmolLM2-135M-Instruct.Q4_1.gguf": gguf, "SmolLM2-135M-Instruct.Q8_0.gguf": gguf}
    snapshot = hub_cache_repo(tmp_path / "hub", GGUF_REPO, files)
    env = offline_env(tmp_path, tmp_path / "hub")
    ambiguous = subprocess.run(
        [STEPSERVE, "serve", "--port", "0", "--model", GGUF_REPO],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **env},
    )
    assert ambiguous.returncode == 2, ambiguous.stderr
    assert f"model '{GGUF_REPO}' holds 2 GGUF files" in ambiguous.stderr
    assert f"--model {GGUF_REPO}:Q4_1" in ambiguous.stderr and "SmolLM2-135M-Instruct.Q8_0.gguf" in ambiguous.stderr
    args = ["--model", f"{GGUF_REPO}:q4_1", "--warmup-prompt-tokens", "0", "--prefix-cache-bytes", "0"]
    server = ServerProcess.start(args, env=env)
    try:
        server.wait_ready()
        with server.client() as client:
            reply = client.post("/infer", json={"prompt": "The capital of France is", "max_tokens": 4})
    finally:
        server.stop()
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
    assert str(snapshot / "SmolLM2-135M-Instruct.Q4_1.gguf") in server.log()
