"""The compile cache: keyed entries, hit/miss counting, compiled == eager, and the
shapeless greedy step proven equal to eager on several shapes."""

from functools import partial

import mlx.core as mx
import pytest

from models import sampling
from models.kv_cache import KVCache
from models.llama import decode
from service.engine.compile_cache import CompileCache, StepKey, StepSpec
from tests.support import TINY, random_params


class Recorder:
    def __init__(self):
        self.lookups, self.compiles = [], []

    def cache(self, enabled=True):
        return CompileCache(enabled, lambda *a: self.lookups.append(a), self.compiles.append)


def test_each_key_compiles_once_and_counts_hits_and_misses():
    rec = Recorder()
    cache = rec.cache()
    spec = StepSpec(lambda x: x * 2 + 1)
    key_a, key_b = StepKey("m", "decode", 1, 256, "float32"), StepKey("m", "decode", 2, 256, "float32")
    for key, n in ((key_a, 3), (key_b, 2)):
        for _ in range(n):
            out = cache.get(key, spec)(mx.ones((key.batch, 4)))
    assert mx.array_equal(out, mx.full((2, 4), 3.0))
    assert [hit for *_, hit in rec.lookups] == [False, True, True, False, True]
    assert [(c.phase, c.bucket) for c in rec.compiles] == [("decode", "b1x256"), ("decode", "b2x256")]
    assert all(c.seconds > 0 for c in rec.compiles)
    assert len(cache) == 2


@pytest.mark.parametrize("batch,capacity", [(1, 16), (4, 32)])
def test_compiled_decode_equals_eager(batch, capacity):
    params = random_params()
    kv = KVCache.allocate(
        TINY.num_hidden_layers, batch, TINY.num_key_value_heads, capacity, TINY.dim_per_head, mx.float32
    )
    kv = KVCache([mx.random.normal(k.shape) for k in kv.keys], [mx.random.normal(v.shape) for v in kv.values])
    tokens = mx.arange(batch).astype(mx.int32) + 3
    positions = (mx.arange(batch) * 3 + 1).astype(mx.int32)
    step = StepSpec(partial(decode, args=TINY))
    key = StepKey("tiny", "decode", batch, capacity, "float32")
    eager_logits, eager_kv = Recorder().cache(False).get(key, step)(params, tokens, positions, kv)
    compiled = Recorder().cache(True).get(key, step)
    for _ in range(2):  # the first call traces, the second runs the cached graph
        logits, new_kv = compiled(params, tokens, positions, kv)
        assert mx.allclose(logits, eager_logits, atol=1e-5)
        assert all(mx.allclose(a, b, atol=1e-6) for a, b in zip(new_kv.keys, eager_kv.keys, strict=True))


def test_shapeless_greedy_equals_eager_on_several_shapes():
    rec = Recorder()
    fn = rec.cache().get(StepKey("m", "greedy", 0, 0, "float32"), StepSpec(sampling.greedy, shapeless=True))
    for shape in [(1, 7), (3, 50), (8, 49152), (5, 1)]:
        logits = mx.random.normal(shape)
        assert mx.array_equal(fn(logits), sampling.greedy(logits)), f"shapeless greedy differs at {shape}"
    assert len(rec.compiles) == 1


def _sample_args(batch, vocab, temperature=0.8, top_p=0.9, top_k=20):
    return (
        mx.full((batch,), temperature),
        mx.full((batch,), top_p),
        mx.full((batch,), top_k, mx.int32),
    )


def test_compiled_sampler_equals_eager_for_seeded_rows():
    logits = mx.random.normal((4, 300))
    keys = mx.stack([mx.random.key(s) for s in (1, 2, 3, 4)])
    seeded = mx.array([True] * 4)
    args = (logits, *_sample_args(4, 300), keys, seeded)
    fn = Recorder().cache().get(StepKey("m", "sample", 4, 0, "float32"), StepSpec(sampling.sample, random_state=True))
    tokens, next_keys = fn(*args)
    eager_tokens, eager_next = sampling.sample(*args)
    assert mx.array_equal(tokens, eager_tokens) and mx.array_equal(next_keys, eager_next)


def test_seeded_row_does_not_depend_on_batchmates():
    mx.random.seed(7)
    logits = mx.random.normal((4, 500)) * 2
    t, p, k = _sample_args(4, 500, temperature=1.0, top_p=1.0, top_k=500)
    keys = mx.stack([mx.random.key(s) for s in (11, 0, 0, 0)])
    seeded = mx.array([True, False, False, False])
    tokens, _ = sampling.sample(logits, t, p, k, keys, seeded)
    alone, _ = sampling.sample(logits[:1], t[:1], p[:1], k[:1], keys[:1], seeded[:1])
    again, _ = sampling.sample(logits, t, p, k, keys, seeded)
    assert tokens[0].item() == alone[0].item() == again[0].item()


def test_filters_restrict_the_choice():
    logits = mx.broadcast_to(mx.arange(100).astype(mx.float32) / 10, (64, 100))
    keys = mx.stack([mx.random.key(s) for s in range(64)])
    seeded = mx.array([True] * 64)
    top3, _ = sampling.sample(logits, *_sample_args(64, 100, 1.0, 1.0, 3), keys, seeded)
    assert set(top3.tolist()) <= {97, 98, 99} and len(set(top3.tolist())) > 1
    nucleus, _ = sampling.sample(logits, *_sample_args(64, 100, 1.0, 1e-6, 100), keys, seeded)
    greedy, _ = sampling.sample(logits, *_sample_args(64, 100, 0.0, 1.0, 100), keys, seeded)
    assert set(nucleus.tolist()) == set(greedy.tolist()) == {99}


@pytest.mark.parametrize("compiled_s,eager_s,keeps_compiled", [(1.0, 2.0, True), (1.0, 1.01, False), (2.0, 1.0, False)])
def test_auto_policy_keeps_the_faster_form(monkeypatch, compiled_s, eager_s, keeps_compiled):
    import service.engine.compile_cache as cc

    spec = StepSpec(lambda x: mx.tanh(x) * 2)
    cache = Recorder().cache("auto")
    entry = cache.get(StepKey("m", "decode", 1, 16, "float32"), spec)
    timings = iter([compiled_s, eager_s])
    monkeypatch.setattr(cc, "median_seconds", lambda fn, args, repeats: next(timings))
    x = mx.random.normal((4,))
    assert entry.calibrate((x,), repeats=3) is keeps_compiled
    assert entry.compiled is keeps_compiled and entry.timings == (compiled_s, eager_s)
    assert mx.allclose(entry(x), spec.fn(x))
    assert cache.choices() == {StepKey("m", "decode", 1, 16, "float32"): keeps_compiled}
