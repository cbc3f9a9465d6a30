"""Speculative decoding in a real `stepserve serve` over real HTTP (the default model, CPU,
float32): one process serves the model three times, with prompt lookup, with
itself as its own draft, and without speculation; greedy answers (and, with prompt lookup,
seeded sampled ones) are exactly those without speculation, alone and in a mixed batch, across
a capacity-bucket move; a copying answer at the defaults accepts proposals; a model drafting for
itself has every proposal accepted."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from models.default import default_model_path
from tests.support import ServerProcess

PASSAGE = (
    "The river near the old mill was quiet in winter, and the keeper of the lantern wrote a letter about it. "
    "In the spring the market filled with stone carvers, and the harbour smelled of salt and bread. "
)
COPY = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"}]
# About 230 prompt tokens and 40 more: the row moves from capacity bucket 256 to 512 mid-answer.
LONG = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PASSAGE * 4}"}]
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 11}


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    config = tmp_path_factory.mktemp("spec") / "stepserve.toml"
    # Prompt buckets 32 and 64: LONG is prefilled in chunks of 64, and each model's warm-up has
    # no 128- and 256-token chunk steps to compile (25 -> 18 s to ready).
    small = "batch_buckets = [1, 2]\nprompt_buckets = [32, 64]\ncapacity_buckets = [256, 512]\n"
    config.write_text(
        "warmup_prompt_tokens = 32\nwarmup_rehearsal = false\n"
        f'[[models]]\nname = "lookup"\nspeculative = "lookup"\n{small}\n'
        f'[[models]]\nname = "plain"\nspeculative = "off"\n{small}\n'
        f'[[models]]\nname = "draft"\nspeculative = "draft"\ndraft_model = "{default_model_path()}"\n'
        f"speculative_tokens = 3\nspeculative_max_batch = 2\n{small}"
    )
    proc = ServerProcess.start(["--config", str(config)])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def infer(server: ServerProcess, messages, model: str | None = None, **sampling) -> str:
    tokens = 40 if messages is LONG else 48
    body = {"messages": messages, "max_tokens": tokens, **sampling, **({"model": model} if model else {})}
    with server.client() as client:
        reply = client.post("/infer", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["text"]


def test_answers_are_those_of_plain_decoding(spec_server):
    plain = {name: infer(spec_server, m, "plain") for name, m in (("copy", COPY), ("long", LONG))}
    plain["sampled"] = infer(spec_server, COPY, "plain", **SAMPLED)
    for model in ("lookup", "draft"):
        assert infer(spec_server, COPY, model) == plain["copy"], model
        assert infer(spec_server, LONG, model) == plain["long"], model
    with ThreadPoolExecutor(2) as pool:  # a mixed batch: a greedy row and a seeded sampled row
        mixed = [
            pool.submit(infer, spec_server, COPY, "lookup"),
            pool.submit(infer, spec_server, COPY, "lookup", **SAMPLED),
        ]
        assert [f.result() for f in mixed] == [plain["copy"], plain["sampled"]]
    proposed = {
        m: spec_server.metric("stepserve_speculative_proposed_tokens_total", model=m) for m in ("lookup", "draft")
    }
    accepted = {
        m: spec_server.metric("stepserve_speculative_accepted_tokens_total", model=m) for m in ("lookup", "draft")
    }
    assert proposed["lookup"] > 0 and accepted["lookup"] > 0
    assert proposed["draft"] > 0 and accepted["draft"] == proposed["draft"]  # its own draft is always right
    assert spec_server.metric("stepserve_bucket_moves_total", kind="capacity") >= 1
    ready = spec_server.client().get("/readyz").json()["models"]
    assert any(k.startswith("verify b1x5c") for k in ready["lookup"]["buckets"])
    assert ready["draft"]["speculative"]["method"] == "draft"
    assert ready["plain"]["speculative"] is None
