"""Rank 0's messages, replayed: a real Engine whose executor is a GroupLeader serves requests
(a chunked prompt, prefix-cache hits and evictions, batch and capacity moves, a prefill longer
than one broadcast), every message it broadcasts is recorded, and a Follower replays them on
its own copy of the model. The follower must end holding exactly what rank 0 still holds
(every other handle freed), each array equal to rank 0's, and the answers must be one
process's. No process is started: the broadcast is replaced by a queue."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import cast

import mlx.core as mx
import pytest

from models.kv_cache import KVCache
from models.loader import LoadedModel
from models.tokenizer import ChatTokenizer
from service.engine import follower as follower_module
from service.engine import group
from service.engine.buckets import BucketTable
from service.engine.compile_cache import CompileCache
from service.engine.core import Engine
from service.engine.executor import Executor
from service.engine.follower import Follower
from service.engine.sequence import FinalEvent, SamplingParams, Sequence
from service.engine.warmup import WarmupSpec
from tests.support import TINY, WordTokenizer, engine_at, random_params, start_engine

BUCKETS = BucketTable(batch=(1, 2, 4), prompt=(8, 48), capacity=(64, 128))
FIRST = [[1 + (7 * i + j) % 90 for i in range(n)] for j, n in enumerate((40, 45, 41, 55, 5))]
MAX_TOKENS = [6, 10, 14, 20, 8, 12, 12]  # rows end at different steps: the batch shrinks; row 3 passes 64
# Then a prompt that starts with the first one (a hit, the rest in a chunk, capacity 128) and a repeat.
SECOND = [FIRST[0] + [3 + i % 80 for i in range(30)], FIRST[1]]
POOL_BLOCKS = 12  # the paged run's pool: a request is preempted, and a prompt hits its blocks
BLOCK_BYTES = 2 * TINY.num_hidden_layers * TINY.num_key_value_heads * 8 * TINY.dim_per_head * 4  # 8 tokens


class Rank:
    """What the executors ask of a group: its size and this process's rank."""

    def __init__(self, rank: int):
        self._rank = rank

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank


LEADER, FOLLOWER = Rank(0), Rank(1)


def serve(model: LoadedModel, paged: bool = False) -> tuple[list[list[int]], Engine]:
    """Greedy tokens of FIRST (the fourth alone, the others joining its batch) and then SECOND,
    from a real engine thread, and the engine; ``paged``: on a paged pool of
    :data:`POOL_BLOCKS` blocks of 8 tokens, fewer than the rows need at once."""
    pool = {"kv_cache": "paged", "kv_pool_tokens": POOL_BLOCKS * 8, "kv_block_tokens": 8} if paged else {}
    engine = engine_at(
        model,
        BUCKETS,
        prefill_chunk_tokens=48,
        max_batched_tokens=192,
        prefix_block_tokens=8,
        prefix_cache_bytes=20 * BLOCK_BYTES,  # fewer blocks than the prompts'
        **pool,
    )
    start_engine(engine, WarmupSpec(prompt_tokens=8, batch=2))
    assert engine.ready.wait(120)
    outputs: list[list[int]] = [[] for _ in FIRST + SECOND]
    started, done = threading.Event(), [threading.Event() for _ in outputs]

    def submit(i: int) -> None:
        def emit(event, i=i):
            started.set()
            if isinstance(event, FinalEvent):
                done[i].set()

        prompt = (FIRST + SECOND)[i]
        seq = Sequence(prompt, SamplingParams(max_tokens=MAX_TOKENS[i]), model.tokenizer.detokenizer(), emit)
        outputs[i] = seq.output_ids
        engine.submit(seq)

    try:
        submit(3)  # alone first, then the others join its batch (a batch move up)
        assert started.wait(120)
        for i in (0, 1, 2, 4):
            submit(i)
        assert all(event.wait(120) for event in done[: len(FIRST)])
        for i in range(len(FIRST), len(outputs)):
            submit(i)
        assert all(event.wait(120) for event in done)
    finally:
        engine.stop()
    assert engine.failure is None
    return outputs, engine


PAGED_OPS = {group.Op.USE_PAGED, group.Op.DECODE_PAGED, group.Op.WRITE_BLOCKS, group.Op.READ_BLOCKS, group.Op.COPY_POOL}


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_a_follower_replays_rank_0_and_frees_what_rank_0_dropped(monkeypatch, kv_cache):
    paged = kv_cache == "paged"
    sent: deque[list[int]] = deque()  # each message, read on the engine thread (MLX streams are per thread)

    def broadcast(x: mx.array, on) -> mx.array:
        if on is FOLLOWER:
            return mx.array(sent.popleft(), mx.int32)
        sent.append(cast(list[int], x.tolist()))
        return x

    monkeypatch.setattr(group, "broadcast", broadcast)
    monkeypatch.setattr(follower_module, "broadcast", broadcast)
    picks: dict[int, list[mx.array]] = {}  # rank -> its chunks' and decode steps' logits (the same model on both)

    def recorded(step):
        def run(self: Executor, *args):
            logits, out = step(self, *args)
            if self.model.group is not None:
                mx.eval(logits)  # here: on the thread that made it
                picks.setdefault(self.model.group.rank(), []).append(logits)
            return logits, out

        return run

    monkeypatch.setattr(Executor, "decode", recorded(Executor.decode))
    monkeypatch.setattr(Executor, "chunk", recorded(Executor.chunk))
    tokenizer = cast(ChatTokenizer, WordTokenizer(frozenset()))
    whole = LoadedModel("tiny", Path("-"), TINY, random_params(seed=5), tokenizer, mx.float32, "dequantized", 0.0)
    alone, _ = serve(whole, paged)
    in_group, engine = serve(replace(whole, group=cast(mx.distributed.Group, LEADER)), paged)
    leader = engine.executor
    assert isinstance(leader, group.GroupLeader) and in_group == alone
    ops = {m[0] for m in sent}
    if paged:  # rank 0's blocks: preempted and resumed, hit, copied on write; the rest as in one process
        assert engine.paged is not None and engine.paged.preemptions > 0 and engine.paged.blocks.hit_tokens > 0
        assert PAGED_OPS - {group.Op.COPY_POOL} <= ops and group.Op.DECODE not in ops
        # A decode step's tables ride its message only when they changed since the last.
        fresh = {m[4 + m[1] + 2] for m in sent if m[0] == group.Op.DECODE_PAGED}
        assert fresh == {0, 1}
    else:
        assert engine.prefix.evicted_blocks > 0 and engine.prefix.hit_tokens > 0
        assert {op.value for op in group.Op} - ops <= {group.Op.IDLE, *PAGED_OPS}  # every other operation ran
        assert any(len(m) > group.HEADER for m in sent)  # a prefill's tokens took a second broadcast

    compiled = CompileCache(True, lambda *a: None, lambda s: None)  # the follower's own, as a rank's process has
    follower = Follower(Executor(replace(whole, group=cast(mx.distributed.Group, FOLLOWER)), compiled))
    follower.run()  # rank 0's warm-up on a thread of its own, then the rest on this one
    assert not sent and not follower.warming
    held = {handle: cast(tuple, finalizer.peek())[0] for handle, finalizer in leader._handles.values()}  # rank 0's
    assert set(follower.store) == set(held) | set(leader._frees)  # frees after the STOP message are not sent
    # Each step read the same keys and values on both: the follower's logits are rank 0's.
    assert len(picks[1]) == len(picks[0]) > 10
    assert all(mx.allclose(a, b, atol=1e-5).item() for a, b in zip(picks[0], picks[1], strict=True))
    if paged:  # every rank's pool holds the same blocks (here, of the same layers)
        mine, theirs = follower.executor.pool, leader.pool
        assert mine is not None and theirs is not None
        for a, b in zip([*mine.keys, *mine.values], [*theirs.keys, *theirs.values], strict=True):
            assert mx.array_equal(a, b).item()
    else:
        assert len(held) == len(engine.prefix) > 0  # the prefix cache's blocks: the decode cache is gone
    for handle, array in held.items():
        mine = follower.store[handle]
        mine = mine.keys[0] if isinstance(mine, KVCache) else mine
        assert mx.array_equal(mine, array).item(), handle


def test_a_group_refuses_models_and_settings_its_stages_cannot_run():
    """Gemma 3's sliding-window rings and Qwen3-MoE's experts are not pipeline stages, and a
    verify step runs in one process only: each is refused at start with the fix named."""
    from service.process.group import unsupported

    assert unsupported("llama", "off") is None and unsupported("qwen3", "off") is None
    for model_type in ("gemma3_text", "qwen3_moe"):
        message = unsupported(model_type, "off")
        assert message is not None and model_type in message and "one process" in message
    message = unsupported("llama", "lookup")
    assert message is not None and "speculative = 'off'" in message
