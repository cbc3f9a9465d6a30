"""mlx-lm's model classes split over two ranks, served for real: `stepserve launch` runs the
real `mlx.launch` (ring backend over 127.0.0.1, CPU) with `stepserve serve --distributed
--model-impl mlx_lm`, each rank keeping its slice of layers through mlx-lm's ``PipelineMixin``.
A tiny random Qwen2 (a Llama-class decoder with QKV biases, 5 layers, split 3 + 2) and a tiny
DeepSeek-V3 (latent attention, a dense then mixture-of-experts layers) answer greedy /infer
requests (a short prompt, a prompt prefilled in two chunks whose decode moves capacity, its
repeat as a prefix-cache hit, two at once) with the token ids of one process and of mlx-lm's own
``generate_step``; each rank holds its layers and the ends only. Llama's mlx-lm module has no
``PipelineMixin``: a group refuses it at start, naming it."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as lm_load_model

from models.hf import tokenizer_from_dir
from models.lm_loader import lm_layout
from tests.e2e.test_pipeline_serving import LONG, TINY_ARGS, launch
from tests.parity.tiny_configs import TINY_CONFIGS
from tests.support import ServerProcess, write_mlx_lm_dir

ARGS = [*TINY_ARGS, "--model-impl", "mlx_lm"]
PROMPTS = [("t5 t7 t9 t11 t2", 16), (LONG, 24), (LONG + " t4", 24)]
TOGETHER = [("t1 t5 t6 t9", 12), ("t2 t5 t6 t9 t40", 12)]
#: model_type -> (config changes, the layers of rank 0 and rank 1, the repeat's cached tokens:
#: 5 blocks of 8, or none where the prefix cache cannot keep its blocks, latent attention's
#: keys being wider than its values)
CASES = {
    "qwen2": ({"num_hidden_layers": 5}, [[3, 5], [0, 3]], 40),
    "deepseek_v3": ({"num_hidden_layers": 3}, None, 0),
}


def greedy(client: httpx.Client, prompt: str, n: int) -> tuple[list[int], int]:
    """(the greedy token ids /infer answers ``prompt`` with, its cached prompt tokens)."""
    body = client.post("/infer", json={"prompt": prompt, "max_tokens": n, "logprobs": 0}).json()
    return [e["token_id"] for e in body["logprobs"]], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def served(server: ServerProcess) -> tuple[list[list[int]], list[int]]:
    """(PROMPTS one after another, then TOGETHER at once: each answer's ids; the cached tokens)."""
    with server.client() as client:
        answers = [greedy(client, p, n) for p, n in PROMPTS]
    both: dict[int, list[int]] = {}

    def ask(i: int) -> None:
        with server.client() as c:
            both[i] = greedy(c, *TOGETHER[i])[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(TOGETHER))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [ids for ids, _ in answers] + [both[i] for i in range(len(TOGETHER))], [c for _, c in answers]


def mlx_lm_ids(directory: Path, prompt: str, n: int) -> list[int]:
    """mlx-lm's own greedy ids for ``prompt`` on ``directory`` (float32), up to a stop token."""
    model, _ = lm_load_model(directory)
    model.set_dtype(mx.float32)
    tokenizer = tokenizer_from_dir(directory, {"eos_token_id": 0})
    out: list[int] = []
    for token, _ in generate_step(mx.array(tokenizer.encode(prompt), mx.int32), model, max_tokens=n):
        if int(token) in tokenizer.stop_token_ids:
            break
        out.append(int(token))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_serve_an_mlx_lm_class_as_one_process_and_mlx_lm(tmp_path, name):
    changes, layers, hit = CASES[name]
    directory = tmp_path / name
    write_mlx_lm_dir(directory, {**TINY_CONFIGS[name], **changes}, seed=1)  # no answer starts with eos
    group, single = launch(directory, ARGS), ServerProcess.start(["--model", str(directory), *ARGS])
    try:
        group.wait_ready()
        single.wait_ready()
        got, cached = served(group)
        ranks = httpx.get(f"{group.url}/readyz").json()["group"]
        moves = group.metric("stepserve_bucket_moves_total", kind="capacity")
        want, _ = served(single)
    finally:
        single.stop()
        code = group.stop()
    assert code == 0, group.log()
    assert got == want, group.log()[-4000:]
    assert got == [mlx_lm_ids(directory, p, n) for p, n in PROMPTS + TOGETHER]
    assert all(len(ids) > 4 for ids in got), got  # not cut short at once by a stop token
    assert cached == [0, 0, hit] and moves >= 1  # a decode moved from capacity 64 to 128
    layout = lm_layout(directory, mx.float32, "dequantized")
    if layers is not None:
        assert [r["layers"] for r in ranks] == layers  # rank 1 runs the first layers
    assert ranks[1]["layers"][0] == 0 and ranks[0]["layers"][1] == len(layout.layer_bytes)
    assert ranks[1]["layers"][1] == ranks[0]["layers"][0]
    for r in ranks:  # its layers and the embedding, norm and head, which every rank runs
        start, stop = r["layers"]
        held = layout.shared_bytes + sum(layout.layer_bytes[start:stop])
        assert r["weights_bytes"] == held // 1024 * 1024, r  # (the exchange counts KiB)
        assert r["weights_bytes"] <= r["active_bytes"] < layout.shared_bytes + sum(layout.layer_bytes), r


def test_a_module_without_pipeline_mixin_is_refused_at_start_naming_it(tmp_path):
    directory = tmp_path / "llama"
    write_mlx_lm_dir(directory, TINY_CONFIGS["llama"])
    group = launch(directory, ARGS)
    code = group.process.wait(120)
    log = group.log()
    assert code == 2, log
    assert "model_type 'llama' cannot be split into pipeline stages" in log
    assert "mlx-lm's llama has no PipelineMixin" in log
