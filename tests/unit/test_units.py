"""Buckets, settings, per-request stop handling and the micro-benchmark functions."""

import dataclasses

import mlx.core as mx
import pytest

from service.config import ConfigError, load_settings
from service.engine import warmup
from service.engine.buckets import BucketLimitError, BucketTable, unpadded_prompt_ladder
from service.engine.prefill import chunk_plan, last_chunk_rows
from service.engine.sequence import FinishReason, SamplingParams, Sequence, TokenEvent
from service.engine.warmup import WarmupSpec

TABLE = BucketTable(batch=(1, 2, 4), prompt=(32, 64, 128), capacity=(256, 512, 1024))


def test_shapes_pad_up_to_the_smallest_bucket():
    assert [TABLE.prompt_for(n) for n in (1, 32, 33, 128)] == [32, 32, 64, 128]
    assert [TABLE.batch_for(n) for n in (1, 2, 3)] == [1, 2, 4]
    assert TABLE.capacity_for(257) == 512


def test_beyond_the_largest_bucket_names_the_limit():
    with pytest.raises(BucketLimitError, match=r"prompt length 129 exceeds the largest prompt length bucket \(128\)"):
        TABLE.prompt_for(129)


def test_warmup_covers_every_step_a_single_request_can_reach():
    steps = warmup.plan(TABLE, WarmupSpec(prompt_tokens=40, chunk_tokens=64, max_batched_tokens=64))
    assert [s for s in steps if s[0] == "prefill"] == [("prefill", 1, 32, 0), ("prefill", 1, 64, 0)]
    assert [s for s in steps if s[0] == "decode"] == [
        ("decode", 1, 256, 0),
        ("decode", 1, 512, 0),
        ("decode", 1, 1024, 0),
    ]
    # chunks (a prefix-cache hit's remainder) at every chunk bucket in the staging capacity of 40 tokens
    assert [s for s in steps if s[0] == "chunk"] == [("chunk", 1, 32, 256), ("chunk", 1, 64, 256)]
    assert steps[-4:] == [("sample", 1, 0, 0), ("process", 1, 0, 0), ("logprobs", 1, 0, 0), ("greedy", 0, 0, 0)]
    assert warmup.plan(TABLE, WarmupSpec(prompt_tokens=0)) == []


def test_warmup_covers_the_batched_last_chunks_of_concurrent_prompts():
    """Several prompts' last chunks run together at one batch bucket per chunk bucket (the
    largest within 8 rows, the warmed batch and the token budget), at every staging capacity."""
    spec = WarmupSpec(prompt_tokens=40, batch=8, chunk_tokens=64, max_batched_tokens=128)
    chunks = [s for s in warmup.plan(TABLE, spec) if s[0] == "chunk"]
    assert [s for s in chunks if s[1] > 1] == [("chunk", 4, 32, 256), ("chunk", 2, 64, 256)]
    single = warmup.plan(TABLE, dataclasses.replace(spec, batched_chunks=False))
    assert [s for s in single if s[0] == "chunk"] == [s for s in chunks if s[1] == 1]
    assert last_chunk_rows(TABLE, 32, 128, rows_cap=1) == 1  # a warmed batch of 1: one by one


def test_long_prompts_last_chunks_run_one_by_one():
    """A batched last-chunk call copies each row's staging cache: it holds at most
    LAST_CHUNK_POSITIONS staging positions, so long prompts' last chunks run alone (and the
    warm-up compiles no batched call there)."""
    long = BucketTable(batch=(1, 2, 4, 8), prompt=(32, 64), capacity=(2048, 4096, 8192, 16384, 32768))
    assert [last_chunk_rows(long, 32, 2048, staging=c) for c in long.capacity] == [8, 4, 2, 1, 1]
    spec = WarmupSpec(prompt_tokens=32767, batch=8, chunk_tokens=64, max_batched_tokens=2048)
    batched = {(s[1], s[3]) for s in warmup.plan(long, spec) if s[0] == "chunk" and s[1] > 1}
    assert batched == {(8, 2048), (4, 4096), (2, 8192)}


def covered(plan: list[tuple[int, int, int]]) -> list[int]:
    """The positions a chunk plan prefills, in order (each chunk's real tokens)."""
    return [p for offset, n, _ in plan for p in range(offset, offset + n)]


@pytest.mark.parametrize("length", [1, 31, 32, 33, 100, 200, 1000, 1024])
def test_an_unpadded_chunk_plan_is_full_prompt_buckets_then_one_token_chunks(length):
    """Recurrent layers that ignore padding: every chunk's bucket is its real tokens, the largest
    prompt bucket within the chunk budget first, the remainder below the smallest one token each."""
    plan = chunk_plan(TABLE, 100, length, 0, exact=True, padded=False)
    assert covered(plan) == list(range(length))
    assert all(n == T and T in (*TABLE.prompt, 1) and T <= 100 for _, n, T in plan)
    sizes = [T for _, _, T in plan]
    assert sizes == sorted(sizes, reverse=True)  # largest first
    ones = sizes.count(1)
    assert ones < TABLE.prompt[0] and ones == (length - sum(s for s in sizes if s > 1))


@pytest.mark.parametrize("length", [2, 17, 30, 31, 63, 100])
def test_an_unpadded_ladder_prefills_a_short_remainder_in_log2_calls(length):
    """A model whose rows cannot be padded gets the powers of two below the smallest prompt
    bucket: a prompt's remainder below it goes in at most log2 of it chunks plus one token, not
    one call per token (a 30-token prompt: 16 + 8 + 4 + 2, four calls instead of thirty)."""
    assert unpadded_prompt_ladder((32, 64, 128)) == (2, 4, 8, 16, 32, 64, 128)
    assert unpadded_prompt_ladder((8, 16)) == (2, 4, 8, 16) and unpadded_prompt_ladder((2, 4)) == (2, 4)
    ladder = BucketTable(TABLE.batch, unpadded_prompt_ladder(TABLE.prompt), TABLE.capacity)
    plan = chunk_plan(ladder, 100, length, 0, exact=True, padded=False)
    assert covered(plan) == list(range(length)) and all(n == T for _, n, T in plan)
    remainder = length % TABLE.prompt[0] if length > TABLE.prompt[0] else length
    calls = [T for _, _, T in plan if T < TABLE.prompt[0]]
    assert len(calls) == bin(remainder).count("1") <= TABLE.prompt[0].bit_length()
    before = chunk_plan(TABLE, 100, length, 0, exact=True, padded=False)
    assert len(before) - len(plan) == remainder - len(calls)  # the one-token calls it saves


def test_a_recurrent_chunk_plan_near_the_largest_capacity_ends_in_one_token_chunks():
    """Chunks of 100 tokens of a 1,024-token prompt: at position 996 no prompt bucket fits
    before 1,024 (once a BucketLimitError mid-prefill); it goes on a token at a time, each
    position once and no chunk ending past the largest capacity bucket."""
    limit = TABLE.capacity[-1]
    plan = chunk_plan(TABLE, 100, limit, 0, exact=True)
    assert covered(plan) == list(range(limit))
    assert all(offset + T <= limit and n <= T for offset, n, T in plan)
    ones = [offset for offset, _, T in plan if T == 1]
    assert ones and ones == list(range(ones[0], limit)) and ones[0] > limit - TABLE.prompt[0]
    padded = chunk_plan(TABLE, 100, limit, 0)  # attention only: recomputes a few positions instead
    assert all(T > 1 for _, _, T in padded) and covered(padded)[-1] == limit - 1


def test_warmup_covers_the_one_token_chunks_of_exact_prefill():
    spec = WarmupSpec(prompt_tokens=1024, batch=2, chunk_tokens=64, max_batched_tokens=128)
    stagings = sorted({TABLE.staging_for(c) for c in TABLE.capacity})

    def one_token(**flags) -> list[tuple[str, int, int, int]]:
        return [s for s in warmup.plan(TABLE, dataclasses.replace(spec, **flags)) if s[0] == "chunk" and s[2] == 1]

    assert one_token() == []
    assert one_token(padded_prompts=False, recurrent=True) == [("chunk", 1, 1, c) for c in stagings] + [
        ("chunk", 2, 1, c) for c in stagings
    ]
    assert one_token(recurrent=True) == [("chunk", 1, 1, stagings[-1]), ("chunk", 2, 1, stagings[-1])]
    short = dataclasses.replace(spec, prompt_tokens=40, recurrent=True)  # never near the largest capacity
    assert [s for s in warmup.plan(TABLE, short) if s[0] == "chunk" and s[2] == 1] == []


def test_settings_precedence_cli_over_env_over_toml(tmp_path, monkeypatch):
    config = tmp_path / "stepserve.toml"
    config.write_text('port = 9001\ncompile = "off"\nbatch_buckets = [1, 8]\nhost = "127.0.0.2"\n')
    monkeypatch.setenv("STEPSERVE_PORT", "9002")
    monkeypatch.setenv("STEPSERVE_PROMPT_BUCKETS", "[16, 32]")
    settings = load_settings(config, host="127.0.0.3")
    assert (settings.port, settings.compile, settings.batch_buckets) == (9002, "off", [1, 8])
    assert settings.prompt_buckets == [16, 32] and settings.host == "127.0.0.3"


def test_bad_settings_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="ascending"):
        load_settings(batch_buckets=[4, 2])
    with pytest.raises(ConfigError, match="largest prompt bucket"):
        load_settings(prompt_buckets=[32, 4096], capacity_buckets=[256, 1024])


class _Detok:
    def __init__(self, pieces):
        self.pieces = pieces

    def step(self, token_id):
        return self.pieces[token_id]


def _run(pieces, stop, max_tokens=50):
    events = []
    seq = Sequence([0], SamplingParams(max_tokens=max_tokens, stop=stop), _Detok(pieces), events.append)
    for token_id in range(1, len(pieces)):
        seq.position += 1
        seq.append(token_id, frozenset({999}), capacity_limit=1000)
        if seq.finish_reason:
            break
    return seq, "".join(e.text for e in events if isinstance(e, TokenEvent))


def test_stop_string_across_tokens_is_cut_and_never_streamed():
    seq, streamed = _run(["", "Hello", " wor", "ld. EN", "D more"], stop=("END",))
    assert seq.finish_reason is FinishReason.STOP
    assert seq.text == streamed == "Hello world. "
    assert seq.final_event().stop_string == "END"  # what Anthropic's stop_sequence reports


def test_the_earliest_of_two_stop_strings_ends_the_text_and_is_reported():
    seq, streamed = _run(["", "one, two; three"], stop=(";", ","))
    assert seq.text == streamed == "one" and seq.final_event().stop_string == ","
    seq, _ = _run(["", "one, two"], stop=("never",), max_tokens=1)
    assert seq.final_event().stop_string is None


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    seq, streamed = _run(["", "a E", "N", "x", "!"], stop=("END",), max_tokens=4)
    assert seq.finish_reason is FinishReason.LENGTH
    assert streamed == seq.text == "a ENx!"


def test_micro_benchmark_functions_compute_what_they_name():
    from service.bench.micro import gelu, plain_vs_compiled, tanh_chain

    x = mx.array([-1.0, 0.0, 2.0])
    assert mx.allclose(gelu(x), mx.array([-0.158655, 0.0, 1.954500]), atol=1e-5)
    assert mx.allclose(tanh_chain(x), mx.array([-0.261639, 0.0, 0.267209]), atol=1e-5)  # tanh applied 20 times
    row = plain_vs_compiled("tanh20", tanh_chain, (8, 8), repeats=2)
    assert row["plain_ms"] > 0 and row["compiled_ms"] > 0
