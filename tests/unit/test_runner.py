"""The decode batch's slot bookkeeping and the runner's decode step on a tiny model: requests
join a running batch, the cache moves between buckets, and every row's logits stay exactly
those of its own sequence."""

from pathlib import Path

import mlx.core as mx
import pytest

from models.loader import LoadedModel
from service.engine.buckets import BucketTable
from service.engine.core import Engine
from service.engine.sequence import SamplingParams, Sequence
from tests.support import ATOL, TINY, engine_at, prefill_one, random_params


@pytest.fixture
def engine() -> Engine:
    model = LoadedModel("tiny", Path("-"), TINY, random_params(), None, mx.float32, "dequantized", 0.0)
    return engine_at(model, BucketTable(batch=(1, 2, 4), prompt=(8, 32), capacity=(16, 32, 64)))


def admit(engine: Engine, live: list[Sequence], prompt: list[int], first_token: int) -> Sequence:
    """What the engine does for one arrival: prefill, fit, insert into a free slot."""
    seq = Sequence(prompt, SamplingParams(), detokenizer=None, emit=lambda e: None)
    _, prompt_kv = engine.prefiller.prefill([prompt])
    seq.position, seq.output_ids = len(prompt), [first_token]
    engine.batch.fit(live, [seq])
    taken = {s.slot for s in live}
    engine.batch.insert(seq, next(i for i in range(engine.batch.kv.batch) if i not in taken), prompt_kv, 0)
    return seq


def check_step(engine: Engine, live: list[Sequence], next_tokens: list[int]) -> None:
    slots = [None] * engine.batch.kv.batch
    for s in live:
        slots[s.slot] = s
    logits = engine.runner.decode(slots)
    for seq, token in zip(live, next_tokens, strict=True):
        expected, _ = prefill_one(engine.model.params, seq.prompt_ids + seq.output_ids)
        assert mx.allclose(logits[seq.slot], expected, atol=ATOL), (
            f"row of a {len(seq.prompt_ids)}-token prompt is wrong"
        )
        seq.position += 1
        seq.output_ids.append(token)
    engine.batch.fit(live)


def test_a_long_prompt_joining_alone_gets_a_capacity_that_holds_it(engine):
    long = admit(engine, [], list(range(1, 21)), 7)  # 20 tokens: prompt bucket 32, capacity 32
    assert engine.batch.kv.capacity == 32
    check_step(engine, [long], [9])


def test_rows_join_leave_and_move_buckets_without_changing_each_other(engine):
    short = admit(engine, [], [5, 6, 7], 11)
    check_step(engine, [short], [12])
    long = admit(engine, [short], list(range(30, 45)), 3)  # 15 tokens joins a batch at capacity 16
    assert (engine.batch.kv.batch, engine.batch.kv.capacity) == (2, 16)
    for token in (4, 8):  # the long row reaches position 16: capacity moves to 32
        check_step(engine, [short, long], [token, token + 1])
    assert engine.batch.kv.capacity == 32
    engine.batch.fit([long])  # the short one leaves: the batch shrinks and the long row moves to slot 0
    assert (engine.batch.kv.batch, long.slot) == (1, 0)
    check_step(engine, [long], [2])


def test_decode_refuses_a_position_beyond_the_capacity(engine):
    seq = admit(engine, [], [1, 2, 3], 4)
    seq.position = engine.batch.kv.capacity
    with pytest.raises(ValueError, match="beyond the KV capacity"):
        engine.runner.decode([seq])
