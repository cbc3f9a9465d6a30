"""A pipeline group on the paged KV pool (``kv_cache = "paged"``): `stepserve launch` of two ranks
(the real `mlx.launch`, ring backend over 127.0.0.1, CPU), each rank holding the pool's blocks
for its own layers while rank 0 decides the block tables, admission and preemption. Greedy
tokens must be those of one process with a static cache answering each request alone: for
prompts of mixed lengths decoding in one batch, a prefix hit on the pool's blocks, and requests
preempted (a pool of 16 blocks) and resumed."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_pipeline_serving import LONG, TINY_ARGS, launch
from tests.support import ServerProcess, write_served_dir

# The pool: 16 blocks of 8 tokens (and the null block), two sequences of up to 128 tokens.
PAGED_ARGS = [*TINY_ARGS, "--kv-cache", "paged", "--kv-pool-tokens", "128", "--kv-block-tokens", "8"]
SHORT = "t5 t7 t9 t11 t2"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A random Llama of 5 layers (split 3 + 2) with an untied head, servable whole."""
    return write_served_dir(
        tmp_path_factory.mktemp("tiny") / "tiny5", {"num_hidden_layers": 5, "tie_word_embeddings": False}
    )


@pytest.fixture(scope="module")
def pair(tiny):
    """The tiny model served by a two-rank group on the paged pool, and by one process with a
    static cache (the same buckets)."""
    group, single = launch(tiny, PAGED_ARGS), ServerProcess.start(["--model", str(tiny), *TINY_ARGS])
    try:
        group.wait_ready()
        single.wait_ready()
        yield group, single
    finally:
        single.stop()
        code = group.stop()
    assert code == 0, group.log()
    assert "rank 1: rank 0 stopped the group" in group.log()


def greedy(client: httpx.Client, prompt: str, max_tokens: int) -> tuple[list[int], int]:
    """(the greedy token ids of ``prompt``, its prompt tokens served from the prefix cache)."""
    body = client.post("/infer", json={"prompt": prompt, "max_tokens": max_tokens, "logprobs": 0}).json()
    return [e["token_id"] for e in body["logprobs"]], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def at_once(server: ServerProcess, requests: list[tuple[str, int]]) -> list[list[int]]:
    """The greedy token ids of ``requests`` (prompt, max_tokens), all sent at once."""
    out: list[list[int]] = [[] for _ in requests]

    def ask(i: int) -> None:
        with server.client() as client:
            out[i] = greedy(client, *requests[i])[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def alone(server: ServerProcess, requests: list[tuple[str, int]]) -> list[list[int]]:
    """The greedy token ids of ``requests``, one after another."""
    with server.client() as client:
        return [greedy(client, *r)[0] for r in requests]


def pool_state(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/readyz").json()["models"]["tiny"]["kv"]


def test_group_on_the_pool_holds_every_rank_s_layers(pair):
    group, _ = pair
    kv = pool_state(group)
    assert kv["cache"] == "paged" and kv["blocks"]["total"] == 16 and kv["block_tokens"] == 8
    assert "paged KV pool: 128 tokens on every rank" in group.log()


def two_row_steps(server: ServerProcess) -> float:
    """Decode steps so far that ran two live rows or more."""
    steps = server.metric("stepserve_batch_size_count", model="tiny", phase="decode")
    return steps - server.metric("stepserve_batch_size_bucket", model="tiny", phase="decode", le="1.0")


def test_mixed_lengths_in_one_batch_answer_as_one_sequence_alone(pair):
    group, single = pair
    requests = [(SHORT, 24), (" ".join(LONG.split()[:27]), 30)]  # 5 and 27 prompt tokens: blocks 1 and 4
    before = two_row_steps(group)
    got = at_once(group, requests)
    assert two_row_steps(group) > before  # the two decoded in one batch
    assert got == alone(single, requests)
    assert all(len(ids) == n for ids, (_, n) in zip(got, requests, strict=True))


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
    requests = [(LONG, 70), (LONG.replace("t2 ", "t3 ", 1) + " t6", 70)]
    got = at_once(group, requests)
    assert pool_state(group)["preemptions"] > before
    assert got == alone(single, requests)
    assert pool_state(group)["blocks"]["used"] == 0  # every block back: free or cached


def test_one_prompt_twice_at_once_shares_blocks_and_copies_on_write(pair):
    group, single = pair
    # 13 tokens: one full block and a partial one, both shared by the twin requests; the first
    # decode step copies the partial block for one of them (copy-on-write, on every rank).
    prompt = "t8 t1 t30 t7 t60 t2 t9 t44 t3 t71 t5 t6 t12"
    got = at_once(group, [(prompt, 16), (prompt, 16)])
    want = alone(single, [(prompt, 16)])[0]
    assert got == [want, want]
