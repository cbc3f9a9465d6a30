"""One scenario of prefills, chunks and decode steps, run either by one process on the whole
model or by every rank of an ``mx.distributed`` group on its pipeline stage.

``mlx.launch --backend ring -n 2 --hosts 127.0.0.1 -- python -m tests.pipeline_ranks MODEL OUT``
starts the ranks (tests/e2e/test_pipeline.py does); each loads only its stage
(:func:`models.stage_loader.load_stage`), writes ``OUT/rank{r}.json`` (its stage, its MLX
active memory after loading, the whole model's bytes) and rank 0 writes ``OUT/logits.safetensors``.
The test runs :func:`scenario` on the whole model in its own process and compares.

Every rank runs the same script (SPMD, as mlx-lm's pipeline_generate): the only value that
depends on a result is each next token, which rank 0 picks (greedy) from its logits and hands
to the others with :func:`models.pipeline.broadcast`. Every step is compiled per shape.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from models.blas import load_cpu_blas

load_cpu_blas()

import mlx.core as mx  # noqa: E402

from models import llama, pipeline  # noqa: E402
from models.kv_cache import KVCache  # noqa: E402
from models.layers import Params  # noqa: E402
from models.model_args import ModelArgs  # noqa: E402
from models.stage_loader import load_stage, model_layout  # noqa: E402

PROMPT_BUCKET, FIRST_CAPACITY, NEXT_CAPACITY = 32, 32, 48  # prefill (2, 32); decode (2, 32) then (2, 48)
LENGTHS = (13, 28)
DECODE_STEPS = 6  # row 1 goes from position 28 to 33: across the move from capacity 32 to 48
CHUNK, STAGING, CHUNKED_PROMPT = 16, 64, 28  # one row prefilled in chunks of 16 on a 64-position cache


def prompt(row: int, length: int, vocab: int) -> list[int]:
    """Deterministic token ids in [2, vocab)."""
    return [2 + (7 * i + 11 * row + 5) % (vocab - 2) for i in range(length)]


class Steps:
    """The three step functions of one model, whole (``stage`` None) or one pipeline stage,
    compiled per shape; ``pick`` turns rank 0's logits into every rank's next tokens."""

    def __init__(self, args: ModelArgs, params: Params, stage: pipeline.Stage | None, group=None):
        self.args, self.params, self.stage, self.group = args, params, stage, group
        self.layers = args.num_hidden_layers if stage is None else stage.stop - stage.start
        self._compiled: dict[tuple, Callable] = {}

    def cache(self, batch: int, capacity: int) -> KVCache:
        a = self.args
        return KVCache.allocate(self.layers, batch, a.num_key_value_heads, capacity, a.dim_per_head, mx.float32)

    def run(self, phase: str, *arrays: mx.array) -> tuple[mx.array | None, KVCache]:
        """One step; returns (logits on rank 0 or the whole model, else None; the new cache)."""
        *inputs, cache = arrays
        key = (phase, *(a.shape for a in inputs), cache.batch, cache.capacity)
        if key not in self._compiled:
            if self.stage is None:
                fn = partial(getattr(llama, phase), args=self.args)
            else:
                fn = partial(getattr(pipeline, phase), args=self.args, stage=self.stage, group=self.group)
            self._compiled[key] = mx.compile(fn)
        out, cache = self._compiled[key](self.params, *inputs, cache)
        mx.eval(out, cache)
        return (out if self.stage is None or self.stage.last else None), cache

    def pick(self, logits: mx.array | None, batch: int) -> mx.array:
        """Greedy next tokens int32 [batch], the same on every rank."""
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32) if logits is not None else mx.zeros(batch, mx.int32)
        return tokens if self.group is None else pipeline.broadcast(tokens, self.group)


def scenario(steps: Steps) -> list[mx.array]:
    """Prefill two prompts (lengths 13 and 28) at prompt bucket 32; decode 6 greedy steps with
    per-row positions, moving the cache from capacity 32 to 48 when row 1 reaches 32; prefill a
    28-token prompt in chunks of 16 on a staging cache of 64 and decode it twice. Returns every
    step's logits on rank 0 (an empty list elsewhere)."""
    vocab, seen = steps.args.vocab_size, []

    def keep(logits):
        if logits is not None:
            seen.append(logits)
        return logits

    rows = [prompt(r, n, vocab) + [0] * (PROMPT_BUCKET - n) for r, n in enumerate(LENGTHS)]
    logits, cache = steps.run("prefill", mx.array(rows, mx.int32), mx.array(LENGTHS, mx.int32), steps.cache(2, 32))
    tokens, positions = steps.pick(keep(logits), 2), mx.array(LENGTHS, mx.int32)
    for _ in range(DECODE_STEPS):
        if max(positions.tolist()) >= cache.capacity:  # a capacity-bucket move: one copy, every rank
            cache = cache.resized(NEXT_CAPACITY)
        logits, cache = steps.run("decode", tokens, positions, cache)
        tokens, positions = steps.pick(keep(logits), 2), positions + 1
    assert cache.capacity == NEXT_CAPACITY

    ids, cache = prompt(2, CHUNKED_PROMPT, vocab), steps.cache(1, STAGING)
    for offset in range(0, CHUNKED_PROMPT, CHUNK):
        part = ids[offset : offset + CHUNK]
        chunk = mx.array([part + [0] * (CHUNK - len(part))], mx.int32)
        logits, cache = steps.run("prefill_chunk", chunk, mx.array([offset]), mx.array([len(part)]), cache)
    tokens = steps.pick(keep(logits), 1)
    for position in (CHUNKED_PROMPT, CHUNKED_PROMPT + 1):
        logits, cache = steps.run("decode", tokens, mx.array([position], mx.int32), cache)
        tokens = steps.pick(keep(logits), 1)
    return seen


def main(model: str, out: Path) -> None:
    group = mx.distributed.init(backend="ring", strict=True)
    mx.set_default_device(mx.cpu)
    layout = model_layout(model, mx.float32, "dequantized")
    stage = layout.split(group.size())[group.rank()]
    loaded = load_stage(model, stage, mx.float32, "dequantized")
    report = {
        "rank": group.rank(),
        "stage": [stage.start, stage.stop],
        "stage_bytes": loaded.nbytes,
        "active_bytes": mx.get_active_memory(),
        "whole_bytes": sum(layout.layer_bytes) + layout.embed_bytes + layout.head_bytes,
    }
    (out / f"rank{group.rank()}.json").write_text(json.dumps(report))
    seen = scenario(Steps(loaded.args, loaded.params, stage, group))
    if stage.last:
        mx.save_safetensors(str(out / "logits.safetensors"), {f"{i:03d}": x for i, x in enumerate(seen)})


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
