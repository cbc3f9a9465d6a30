"""The model runner's slot bookkeeping on a tiny model: requests join a running batch, the
cache moves between buckets, and every row's logits stay exactly those of its own sequence."""

from pathlib import Path

import mlx.core as mx
import pytest

from models.loader import LoadedModel
from service.engine.buckets import BucketTable
from service.engine.compile_cache import CompileCache
from service.engine.runner import ModelRunner
from service.engine.sequence import SamplingParams, Sequence
from tests.support import ATOL, TINY, prefill_one, random_params


@pytest.fixture
def runner() -> ModelRunner:
    model = LoadedModel("tiny", Path("-"), TINY, random_params(), None, mx.float32, "dequantized", 0.0)
    buckets = BucketTable(batch=(1, 2, 4), prompt=(8, 32), capacity=(16, 32, 64))
    return ModelRunner(model, buckets, CompileCache(True, lambda *a: None, lambda s: None))


def admit(runner: ModelRunner, live: list[Sequence], prompt: list[int], first_token: int) -> Sequence:
    """What the engine does for one arrival: prefill, fit, insert into a free slot."""
    seq = Sequence(prompt, SamplingParams(), detokenizer=None, emit=lambda e: None)
    _, prompt_kv = runner.prefill([prompt])
    seq.position, seq.output_ids = len(prompt), [first_token]
    runner.fit(live, [seq])
    taken = {s.slot for s in live}
    runner.insert(seq, next(i for i in range(runner.kv.batch) if i not in taken), prompt_kv, 0)
    return seq


def check_step(runner: ModelRunner, live: list[Sequence], next_tokens: list[int]) -> None:
    slots = [None] * runner.kv.batch
    for s in live:
        slots[s.slot] = s
    logits = runner.decode(slots)
    for seq, token in zip(live, next_tokens, strict=True):
        expected, _ = prefill_one(runner.model.params, seq.prompt_ids + seq.output_ids)
        assert mx.allclose(logits[seq.slot], expected, atol=ATOL), (
            f"row of a {len(seq.prompt_ids)}-token prompt is wrong"
        )
        seq.position += 1
        seq.output_ids.append(token)
    runner.fit(live)


def test_a_long_prompt_joining_alone_gets_a_capacity_that_holds_it(runner):
    long = admit(runner, [], list(range(1, 21)), 7)  # 20 tokens: prompt bucket 32, capacity 32
    assert runner.kv.capacity == 32
    check_step(runner, [long], [9])


def test_rows_join_leave_and_move_buckets_without_changing_each_other(runner):
    short = admit(runner, [], [5, 6, 7], 11)
    check_step(runner, [short], [12])
    long = admit(runner, [short], list(range(30, 45)), 3)  # 15 tokens joins a batch at capacity 16
    assert (runner.kv.batch, runner.kv.capacity) == (2, 16)
    for token in (4, 8):  # the long row reaches position 16: capacity moves to 32
        check_step(runner, [short, long], [token, token + 1])
    assert runner.kv.capacity == 32
    runner.fit([long])  # the short one leaves: the batch shrinks and the long row moves to slot 0
    assert (runner.kv.batch, long.slot) == (1, 0)
    check_step(runner, [long], [2])


def test_decode_refuses_a_position_beyond_the_capacity(runner):
    seq = admit(runner, [], [1, 2, 3], 4)
    seq.position = runner.kv.capacity
    with pytest.raises(ValueError, match="beyond the KV capacity"):
        runner.decode([seq])
