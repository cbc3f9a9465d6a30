"""A pipeline group on the paged KV pool (``kv_cache = "paged"``): `stepserve launch` of two ranks
(the real `mlx.launch`, ring backend over 127.0.0.1, CPU), each rank holding the pool's blocks
for its own layers while rank 0 decides the block tables, admission and preemption. Greedy
tokens must be those of one process with a static cache answering each request alone: for
prompts of mixed lengths decoding in one batch, a prefix hit on the pool's blocks, and requests
preempted (a pool of 16 blocks) and resumed; the same for mlx-lm's class of a tiny Qwen2, and
a class whose caches no pool holds refused at start."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_pipeline_serving import LONG, TINY_ARGS, group_and_single, launch, tiny_five_layers
from tests.parity.tiny_configs import TINY_CONFIGS
from tests.support import ServerProcess, write_mlx_lm_dir, write_served_dir

# The pool: 16 blocks of 8 tokens (and the null block), two sequences of up to 128 tokens.
PAGED_ARGS = [*TINY_ARGS, "--kv-cache", "paged", "--kv-pool-tokens", "128", "--kv-block-tokens", "8"]
SHORT = "t5 t7 t9 t11 t2"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_five_layers(tmp_path_factory)


@pytest.fixture(scope="module")
def pair(tiny):
    """The tiny model served by a two-rank group on the paged pool, and by one process with a
    static cache (the same buckets)."""
    yield from group_and_single(tiny, PAGED_ARGS)


def greedy(client: httpx.Client, prompt: str, max_tokens: int) -> tuple[list[int], int]:
    """(the greedy token ids of ``prompt``, all ``max_tokens`` of them, its prompt tokens served
    from the prefix cache)."""
    request = {"prompt": prompt, "max_tokens": max_tokens, "logprobs": 0, "ignore_eos": True}
    body = client.post("/infer", json=request).json()
    return [e["token_id"] for e in body["logprobs"]], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def pool_state(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/readyz").json()["models"]["tiny"]["kv"]


def test_group_on_the_pool_holds_every_rank_s_layers(pair):
    group, _ = pair
    kv = pool_state(group)
    assert kv["cache"] == "paged" and kv["blocks"]["total"] == 16 and kv["block_tokens"] == 8
    assert "paged KV pool: 128 tokens on every rank" in group.log()


def test_a_pool_sized_by_the_budget_is_the_least_any_rank_holds(tiny):
    """Unset kv_pool_tokens: each rank sizes a pool from its budget for its own layers (rank 1
    holds 3 of the 5, rank 0 2), and every rank allocates the least, rank 0's block ids naming
    the same blocks everywhere."""
    args = [a for a in PAGED_ARGS if a not in ("--kv-pool-tokens", "128")]
    group = launch(tiny, [*args, "--memory-budget-bytes", "20000000"])
    try:
        group.wait_ready()
        kv = pool_state(group)
        with group.client() as client:
            assert len(greedy(client, LONG, 8)[0]) == 8
    finally:
        code = group.stop()
    log = group.log()
    assert code == 0, log
    each = re.findall(r"rank (\d) stepserve: model tiny: paged KV pool of (\d+) tokens", log)
    sized = {int(rank): int(tokens) for rank, tokens in each}
    assert sized[1] < sized[0]  # rank 1's layers take more bytes per token
    assert f"paged KV pool: {sized[1]} tokens on every rank" in log
    assert kv["tokens"] == -(-sized[1] // 8) * 8  # whole blocks, as in one process


def two_row_steps(server: ServerProcess) -> float:
    """Decode steps so far that ran two live rows or more."""
    steps = server.metric("stepserve_batch_size_count", model="tiny", phase="decode")
    return steps - server.metric("stepserve_batch_size_bucket", model="tiny", phase="decode", le="1.0")


Answer = tuple[str, list[float]]


def completions(server: ServerProcess, prompts: list[str], max_tokens: int) -> list[Answer]:
    """The greedy (text, each token's logprob) of ``prompts``, all ``max_tokens`` tokens long,
    from one /v1/completions request (its prompts are submitted together: they decode in one
    batch)."""
    body = {"model": "tiny", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body["logprobs"] = 0
    choices = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300).json()["choices"]
    return [(c["text"], c["logprobs"]["token_logprobs"]) for c in sorted(choices, key=lambda c: c["index"])]


def alone(server: ServerProcess, prompts: list[str], max_tokens: int) -> list[Answer]:
    """:func:`completions` of each prompt alone, one after another."""
    return [completions(server, [p], max_tokens)[0] for p in prompts]


def assert_same(got: list[Answer], want: list[Answer]) -> None:
    """The same greedy tokens, and logprobs within float32 rounding of the two attention paths:
    keys and values a rank lost or misplaced move them even where the greedy token holds."""
    assert [text for text, _ in got] == [text for text, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, (a, b)


def test_mixed_lengths_in_one_batch_answer_as_one_sequence_alone(pair):
    group, single = pair
    prompts = [SHORT, " ".join(LONG.split()[:27])]  # 5 and 27 prompt tokens: 1 and 4 blocks
    before = two_row_steps(group)
    got = completions(group, prompts, 30)
    assert two_row_steps(group) > before  # the two decoded in one batch
    assert_same(got, alone(single, prompts, 30))


def test_prefix_hit_on_the_pool_answers_as_one_process(pair):
    group, single = pair
    with group.client() as g, single.client() as s:
        first, repeat = greedy(g, LONG, 20), greedy(g, LONG + " t4", 20)
        assert first[0] == greedy(s, LONG, 20)[0]
        assert repeat[0] == greedy(s, LONG + " t4", 20)[0]
    assert repeat[1] == 40  # the repeat took the first's 5 full blocks of 8 from the pool


def test_preempted_and_resumed_answers_as_one_sequence_alone(pair):
    group, single = pair
    before = pool_state(group)["preemptions"]
    # Two 41-token prompts of 70 tokens each need 14 blocks apiece, the pool has 16: the newer
    # is preempted when the pool runs out, then resumes (its prompt and output prefilled again).
    prompts = [LONG, LONG.replace("t2 ", "t3 ", 1)]
    got = completions(group, prompts, 70)
    assert pool_state(group)["preemptions"] > before
    assert_same(got, alone(single, prompts, 70))
    assert pool_state(group)["blocks"]["used"] == 0  # every block back: free or cached


def test_one_prompt_twice_at_once_shares_blocks_and_copies_on_write(pair):
    group, single = pair
    # 13 tokens: one full block and a partial one, both shared by the twin requests; the first
    # decode step copies the partial block for one of them (copy-on-write, on every rank).
    prompt = "t8 t1 t30 t7 t60 t2 t9 t44 t3 t71 t5 t6 t12"
    assert_same(completions(group, [prompt, prompt], 16), alone(single, [prompt, prompt], 16))


# -- mlx-lm's classes -------------------------------------------------------------------------


def test_an_mlx_lm_class_split_in_two_on_the_pool_answers_as_one_process(tmp_path):
    """A tiny Qwen2 through mlx-lm's class (its PipelineMixin passes the hidden states): each
    rank's pool holds its layers' blocks; a prefix hit, and two requests preempted and resumed."""
    directory = tmp_path / "qwen2"
    write_mlx_lm_dir(directory, {**TINY_CONFIGS["qwen2"], "num_hidden_layers": 5}, seed=1)
    args = [*TINY_ARGS, "--model-impl", "mlx_lm"]
    group = launch(directory, [*args, "--kv-cache", "paged", "--kv-pool-tokens", "128", "--kv-block-tokens", "8"])
    single = ServerProcess.start(["--model", str(directory), *args])
    sequential = [(SHORT, 16), (LONG, 24), (LONG + " t4", 24)]
    together = [LONG, LONG.replace("t2 ", "t3 ", 1)]  # preempted, as above
    try:
        group.wait_ready()
        single.wait_ready()
        with group.client() as client, single.client() as one:
            got, want = [greedy(client, *r) for r in sequential], [greedy(one, *r)[0] for r in sequential]
        got_together, kv = completions(group, together, 70), pool_state(group)
        want_together = alone(single, together, 70)
    finally:
        single.stop()
        code = group.stop()
    assert code == 0, group.log()
    assert [ids for ids, _ in got] == want
    assert_same(got_together, want_together)
    assert got[2][1] == 40 and kv["preemptions"] > 0 and kv["blocks"]["used"] == 0


def test_an_mlx_lm_class_the_pool_cannot_hold_is_refused_at_start_naming_the_keys(tmp_path):
    """DeepSeek-V3's latent attention keeps keys wider than values: no pool holds them, so
    every rank refuses at start (exit 2), naming kv_cache, the model type and the fix."""
    directory = tmp_path / "deepseek_v3"
    write_mlx_lm_dir(directory, {**TINY_CONFIGS["deepseek_v3"], "num_hidden_layers": 3}, seed=1)
    group = launch(directory, [*TINY_ARGS, "--model-impl", "mlx_lm", "--kv-cache", "paged", "--kv-pool-tokens", "128"])
    code = group.process.wait(120)
    log = group.log()
    assert code == 2, log
    assert "--distributed: kv_cache = 'paged' cannot hold the caches of model_type 'deepseek_v3'" in log
    assert "set kv_cache = 'static'" in log and "Traceback" not in log


QuantizedAnswer = tuple[list[str], list[float], list[dict[str, float]]]


def top_two(server: ServerProcess, prompt: str, max_tokens: int) -> QuantizedAnswer:
    """A greedy answer's (tokens, their logprobs, each position's two likeliest tokens' logprobs)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    logprobs = httpx.post(f"{server.url}/v1/completions", json=body | {"logprobs": 2}, timeout=300).json()
    logprobs = logprobs["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]


def assert_same_but_near_ties(got: QuantizedAnswer, want: QuantizedAnswer, tolerance: float = 5e-3) -> None:
    """The same greedy tokens with logprobs within ``tolerance``, up to a position where the two
    chose differently between tokens whose logprobs lie within ``tolerance`` (a near tie).

    A group stages a prompt's keys and values quantized and dequantized, one process writes them
    into its quantized blocks: the two attend to float32 rounding of each other, but a key that
    rounding puts on the other side of a quantization step moves a logprob by about 1e-3."""
    tokens, logprobs, top = got
    their_tokens, their_logprobs, _ = want
    split = next((i for i, pair in enumerate(zip(tokens, their_tokens, strict=True)) if pair[0] != pair[1]), None)
    end = len(tokens) if split is None else split
    assert max((abs(a - b) for a, b in zip(logprobs[:end], their_logprobs[:end], strict=True)), default=0.0) < tolerance
    if split is not None:
        choices = top[split]
        assert their_tokens[split] in choices, (split, choices, their_tokens[split])
        assert abs(choices[tokens[split]] - choices[their_tokens[split]]) < tolerance, (split, choices)


def test_a_quantized_pool_split_in_two_answers_as_one_process_on_it(tmp_path):
    """``kv_bits 8``: each rank keeps its layers' blocks quantized (a head dim of 64); requests
    of different lengths and a prefix hit answer as one process on the same pool, each request
    alone, but for near ties (:func:`assert_same_but_near_ties`). A batch that preempts
    completes; its tokens are not compared: where a request is preempted depends on the timing
    of a batch's arrivals."""
    model = write_served_dir(
        tmp_path / "tiny64",
        {"num_hidden_layers": 5, "tie_word_embeddings": False, "hidden_size": 128, "num_attention_heads": 2},
    )
    quantized = [*PAGED_ARGS, "--kv-bits", "8"]
    group, single = launch(model, quantized), ServerProcess.start(["--model", str(model), *quantized])
    prompts, repeated = [SHORT, " ".join(LONG.split()[:27])], [LONG, LONG + " t4"]
    try:
        group.wait_ready()
        single.wait_ready()
        requests = [(prompt, 30) for prompt in prompts] + [(prompt, 20) for prompt in repeated]
        got = [top_two(group, prompt, n) for prompt, n in requests]
        preempted = completions(group, [LONG, LONG.replace("t2 ", "t3 ", 1)], 70)
        kv = pool_state(group)
        want = [top_two(single, prompt, n) for prompt, n in requests]
    finally:
        single.stop()
        code = group.stop()
    assert code == 0, group.log()
    for g, w in zip(got, want, strict=True):
        assert_same_but_near_ties(g, w)
    assert kv["kv_bits"] == 8 and kv["preemptions"] > 0 and kv["blocks"]["used"] == 0
    assert [len(logprobs) for _, logprobs in preempted] == [70, 70]
