"""A model split over two ranks, served for real: `stepserve launch` runs the real `mlx.launch`
(ring backend over 127.0.0.1, CPU) with `stepserve serve --distributed`, and clients talk HTTP
to rank 0. Greedy answers must be a single process's (a random 5-layer model with an untied
head, split 3 + 2, and the default model), each rank must hold its stage only, and a rank that
dies, hangs or cannot start must end the group: requests end with an error, /readyz answers
503 first, the group exits non-zero."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import httpx
import mlx.core as mx
import pytest

from models import llama
from models.default import default_model_path
from models.kv_cache import KVCache
from models.loader import load_model
from service.bench.servers import free_port, free_ports
from tests.support import STEPSERVE, ServerProcess, write_served_dir

# Small buckets: the 41-token prompt below is prefilled in two chunks and its decode moves
# from capacity 64 to 128; blocks of 8 tokens make its repeat a prefix-cache hit.
TINY_ARGS = [
    *("--model-name", "tiny", "--batch-buckets", "1,2", "--prompt-buckets", "16,32"),
    *("--capacity-buckets", "64,128", "--prefill-chunk-tokens", "32", "--max-batched-tokens", "64"),
    *("--prefix-block-tokens", "8", "--warmup-prompt-tokens", "32", "--warmup-batch", "2"),
]
LONG = " ".join(f"t{2 + (7 * i) % 90}" for i in range(41))


def launch(model: Path | None, args: list[str], kill_after: float = 5) -> ServerProcess:
    """`stepserve launch` of two ranks on loopback (``model`` None: the default model), in a
    session of its own; its output, every rank's included, is ``.log()``."""
    port, ring = free_port(), free_ports(2)  # the ring listens on ring and ring + 1
    log = Path(tempfile.mkstemp(prefix="stepserve-group-", suffix=".log")[1])
    command = [STEPSERVE, "launch", "--kill-after", str(kill_after), "--backend", "ring", "-n", "2"]
    command += ["--hosts", "127.0.0.1", "--starting-port", str(ring), "--", "--port", str(port)]
    command += ["--model", str(model)] if model is not None else []
    with log.open("wb") as out:
        proc = subprocess.Popen([*command, *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return ServerProcess(proc, port, log)


def tiny_five_layers(tmp_path_factory) -> Path:
    """A random Llama of 5 layers (split 3 + 2) with an untied head, servable whole."""
    return write_served_dir(
        tmp_path_factory.mktemp("tiny") / "tiny5", {"num_hidden_layers": 5, "tie_word_embeddings": False}
    )


def group_and_single(model: Path, group_args: list[str]) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """``model`` served by a two-rank group with ``group_args`` and by one process with
    :data:`TINY_ARGS`, both ready; on exit both stopped, the group cleanly."""
    group, single = launch(model, group_args), ServerProcess.start(["--model", str(model), *TINY_ARGS])
    try:
        group.wait_ready()
        single.wait_ready()
        yield group, single
    finally:
        single.stop()
        code = group.stop()  # SIGTERM to `stepserve launch`: rank 0 drains, then stops rank 1
    assert code == 0, group.log()
    assert "rank 1: rank 0 stopped the group" in group.log()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_five_layers(tmp_path_factory)


@pytest.fixture(scope="module")
def pair(tiny):
    """The tiny model served by a two-rank group and by one process, the same settings."""
    yield from group_and_single(tiny, TINY_ARGS)


def answers(server: ServerProcess) -> list:
    """Greedy answers to /infer (short, chunked, a prefix hit, streamed, two at once) and the
    OpenAI routes, as (text, usage) or text."""
    out: list = []
    with server.client() as client:
        for prompt, n in (("t5 t7 t9 t11 t2", 20), (LONG, 30), (LONG + " t4", 30)):
            body = client.post("/infer", json={"prompt": prompt, "max_tokens": n}).json()
            out.append((body["text"], body["usage"]))
        with client.stream("POST", "/infer", json={"prompt": "t3 t30 t60", "max_tokens": 12, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        out.append("".join(e.get("text", "") for e in events))
        completion = {"model": "tiny", "prompt": "t8 t9", "max_tokens": 10, "temperature": 0}
        out.append(client.post("/v1/completions", json=completion).json()["choices"][0]["text"])
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "t4 t5"}], "max_tokens": 10, "temperature": 0}
        out.append(client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"])
    both: dict[int, str] = {}

    def ask(i: int) -> None:
        with server.client() as c:
            both[i] = c.post("/infer", json={"prompt": f"t{i} t5 t6 t9", "max_tokens": 15}).json()["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [*out, both]


def test_two_ranks_answer_as_one_process(pair):
    group, single = pair
    got, want = answers(group), answers(single)
    assert got == want
    assert got[2][1]["prompt_tokens_details"]["cached_tokens"] == 40  # the repeat hit 5 blocks of 8
    assert group.metric("stepserve_bucket_moves_total", kind="capacity") >= 1  # decode moved from 64 to 128


def test_each_rank_holds_its_stage_only(pair):
    group, _ = pair
    ranks = httpx.get(f"{group.url}/readyz").json()["group"]
    assert [r["layers"] for r in ranks] == [[3, 5], [0, 3]]  # rank 1 runs the embedding and the first layers
    whole = sum(r["weights_bytes"] for r in ranks)  # an untied head: the two ends share no table
    for r in ranks:
        assert r["weights_bytes"] <= r["active_bytes"] < r["weights_bytes"] + (1 << 20), r
        assert r["active_bytes"] < 0.7 * whole, r


def argmax(logits: mx.array) -> int:
    return cast(list[int], mx.argmax(logits, axis=-1).tolist())[0]


def greedy_alone(prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[int], str]]:
    """(prompt ids, greedy ids, their text) of the default model in this process for each
    prompt, eagerly, at the shapes a server with prompt bucket 64 and capacity bucket 256 runs:
    prefill (1, 64), decode (1, 256)."""
    model = load_model(default_model_path(), "whole", mx.float32, "dequantized")
    a, out = model.args, []
    for prompt in prompts:
        ids = model.tokenizer.encode(prompt)
        cache = KVCache.allocate(a.num_hidden_layers, 1, a.num_key_value_heads, 64, a.dim_per_head, mx.float32)
        tokens = mx.array([ids + [0] * (64 - len(ids))], mx.int32)
        logits, cache = llama.prefill(model.params, tokens, mx.array([len(ids)], mx.int32), cache, args=a)
        new, cache = [argmax(logits)], cache.resized(256)
        while len(new) < max_tokens:
            position = mx.array([len(ids) + len(new) - 1], mx.int32)
            logits, cache = llama.decode(model.params, mx.array(new[-1:], mx.int32), position, cache, args=a)
            new.append(argmax(logits))
        out.append((ids, new, model.tokenizer.decode(new)))
    return out


def test_the_default_model_split_in_two_answers_as_one_process():
    # Eager on both sides (compiling the default model's stages takes a minute on 2 cores; the
    # tiny group above compiles): the group's steps and these are the same arithmetic, split.
    args = ["--compile", "off", "--warmup-prompt-tokens", "0", "--capacity-buckets", "256", "--prompt-buckets", "64"]
    group = launch(None, [*args, "--prefill-chunk-tokens", "64", "--max-batched-tokens", "64"])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    try:
        group.wait_ready()
        body = {"prompt": "The capital of France is", "max_tokens": 12, "logprobs": 0}
        got = httpx.post(f"{group.url}/infer", json=body, timeout=300).json()
        chat = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 12, "temperature": 0}
        chat_reply = httpx.post(f"{group.url}/v1/chat/completions", json=chat, timeout=300).json()
        ranks = httpx.get(f"{group.url}/readyz").json()["group"]
    finally:
        assert group.stop() == 0, group.log()
    tokenizer = load_model(default_model_path(), "whole", mx.float32, "dequantized").tokenizer
    (ids, want, _), (chat_ids, _, chat_want) = greedy_alone(
        [body["prompt"], tokenizer.apply_chat_template(messages)], body["max_tokens"]
    )
    assert got["usage"]["prompt_tokens"] == len(ids) and [e["token_id"] for e in got["logprobs"]] == want
    assert "Paris" in got["text"]
    assert chat_reply["usage"]["prompt_tokens"] == len(chat_ids)
    choice = chat_reply["choices"][0]  # it stops at the end-of-turn token; the greedy run here does not
    assert choice["finish_reason"] == "stop" and "Paris" in choice["message"]["content"], choice
    assert chat_want.startswith(choice["message"]["content"]), (choice, chat_want)
    whole = 538_140_672  # the default model's parameters in one process (float32, dequantized)
    assert [r["layers"] for r in ranks] == [[15, 30], [0, 15]]
    for r in ranks:  # each rank: its 15 layers and the 113 MB embedding table (tied: both ends hold it)
        assert r["weights_bytes"] <= r["active_bytes"] < 0.65 * whole, r


# -- faults ------------------------------------------------------------------------------------

FAULT_ARGS = [
    *("--model-name", "tiny", "--batch-buckets", "1", "--prompt-buckets", "16", "--capacity-buckets", "4096"),
    *("--prefill-chunk-tokens", "16", "--max-batched-tokens", "16", "--warmup-prompt-tokens", "0"),
]


def signal_mid_stream(model: Path, rank: int, sig: int, args: tuple[str, ...] = ()) -> dict:
    """Start a group, stream a long greedy request, send ``sig`` to ``rank`` after its third
    token, and poll /readyz until `stepserve launch` exits. Returns the stream's events, the
    /readyz answers ("down" once nothing listens, "slow" for one not answered within 5 s), the
    exit status, seconds from the signal to the first 503 and to the exit, and the log."""
    group = launch(model, [*FAULT_ARGS, *args], kill_after=8)  # rank 0 ends its requests first, even when slow
    group.wait_ready()
    pids = {r["rank"]: r["pid"] for r in httpx.get(f"{group.url}/readyz").json()["group"]}
    events: list = []

    def stream() -> None:
        body = {"prompt": "t5 t7 t9", "max_tokens": 4000, "stream": True}
        try:
            with httpx.stream("POST", f"{group.url}/infer", json=body, timeout=60) as reply:
                events.extend(json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: "))
        except httpx.TransportError as exc:
            events.append({"transport_error": repr(exc)})

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(pids[rank], sig)
    signalled, codes, first_503 = time.monotonic(), [], None
    with httpx.Client(base_url=group.url, timeout=5) as client:
        while group.process.poll() is None and time.monotonic() - signalled < 60:
            try:
                codes.append(client.get("/readyz").status_code)
            except httpx.TimeoutException:  # a slow answer on a loaded machine, not a server gone
                codes.append("slow")
            except httpx.TransportError:
                codes.append("down")
            if codes[-1] == 503 and first_503 is None:
                first_503 = time.monotonic() - signalled
            time.sleep(0.02)
    exit_s = time.monotonic() - signalled
    reader.join(30)
    status = group.stop()
    return {
        "events": events,
        "codes": codes,
        "status": status,
        "first_503": first_503,
        "exit_s": exit_s,
        "log": group.log(),
    }


def test_a_killed_rank_1_fails_the_request_and_the_group_after_a_503(tiny):
    run = signal_mid_stream(tiny, 1, signal.SIGKILL)
    # The request ends with an error event naming the failure: the ring's error when rank 0's engine
    # saw it, or the rank `stepserve launch` saw exit when a collective started after the kill never
    # returned (MLX's ring backend fails only the pending ones; without the launcher's word the
    # stream was cut when the group was killed).
    last = run["events"][-1]
    assert "the pipeline group failed" in str(last.get("error")), run["events"][-3:]
    assert 503 in run["codes"] and "down" not in run["codes"][: run["codes"].index(503)], run["codes"]
    assert run["status"] != 0 and run["exit_s"] < 30, run["log"]
    assert "the group stopped: rank 1 was killed" in run["log"] or "rank 1 exited with code -9" in run["log"]


def test_a_killed_rank_0_ends_the_stream_and_the_group(tiny):
    run = signal_mid_stream(tiny, 0, signal.SIGKILL)
    assert "transport_error" in run["events"][-1], run["events"][-3:]  # cut off: rank 0 served it
    assert run["status"] != 0 and run["exit_s"] < 30, run["log"]
    assert "rank 1: the pipeline group failed" in run["log"]  # rank 1 saw the link drop and exited


def test_a_hung_rank_1_fails_the_request_and_the_group_within_the_timeout(tiny):
    timeout_s = 2
    run = signal_mid_stream(tiny, 1, signal.SIGSTOP, ("--distributed-timeout-s", str(timeout_s)))
    assert "stopped answering" in run["events"][-1]["error"]["message"], run["events"][-3:]
    # Not before the timeout: the wait rank 0 gave up on had lasted it, by rank 0's own clock (the
    # wait may have begun a step before the signal, so the time since the signal says nothing).
    stalled = re.search(r"the pipeline group has not answered for ([0-9.]+) s", run["log"])
    assert stalled is not None and float(stalled[1]) >= timeout_s, run["log"]
    # Within it, with a margin for a loaded machine (the watchdog looks every 0.2 s).
    assert run["first_503"] is not None and run["first_503"] < timeout_s + 8, run["codes"]
    assert "down" not in run["codes"][: run["codes"].index(503)]
    assert run["status"] != 0 and run["exit_s"] < 30, run["log"]  # mlx.launch waits on the stopped rank: killed


def test_a_rank_whose_stage_does_not_fit_fails_the_start_naming_it(tiny):
    # One sequence at capacity 4096 (D 16, 2 KV heads: 256 bytes per layer and position): rank
    # 1's three layers need 7.8 MB at worst (weights, the decode cache twice, a chunk's scores),
    # rank 0's two 5.6 MB; each may use 6.7 MB.
    args = [*FAULT_ARGS, "--max-sequences", "1", "--prefix-cache-bytes", "0"]  # capacity 4096
    group = launch(tiny, [*args, "--memory-budget-bytes", "6700000"])
    try:
        status = group.process.wait(120)
    finally:
        group.stop()
    log = group.log()
    assert status == 2, log
    reason = log.split("rank 0 cannot serve: ")[1].split("\n")[0]
    assert reason.startswith("rank 1 on") and "could not start (loading the stages)" in reason, log
    assert "over memory_budget_bytes" in reason and "rank 0 on" not in reason
