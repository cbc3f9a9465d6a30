"""The compile cache: keyed entries, hit/miss counting, compiled == eager, and the
shapeless greedy step proven equal to eager on several shapes."""

import math
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


def test_each_key_holds_only_its_own_traces():
    """MLX scans a callable's traces in turn on every call, comparing input shapes: each key
    compiles a callable of its own, so a step never scans the other buckets' traces (a
    shared callable would find key b's trace when key a's function meets b's shapes)."""
    traced = []

    def step(x):
        traced.append(x.shape)
        return x + 1

    cache, spec = Recorder().cache(), StepSpec(step)
    key_a, key_b = StepKey("m", "decode", 1, 8, "float32"), StepKey("m", "decode", 2, 8, "float32")
    fn_a, fn_b = cache.get(key_a, spec), cache.get(key_b, spec)
    fn_a(mx.ones((1, 8)))
    fn_b(mx.ones((2, 8)))
    fn_a(mx.ones((2, 8)))  # b's shapes through a's function: traced again, a's callable has no b trace
    assert traced == [(1, 8), (2, 8), (2, 8)]


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


def _sample_args(batch, vocab, temperature=0.8, top_p=0.9, top_k=20, min_p=0.0):
    return (
        mx.full((batch,), temperature),
        mx.full((batch,), top_p),
        mx.full((batch,), top_k, mx.int32),
        mx.full((batch,), min_p),
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
    t, p, k, m = _sample_args(4, 500, temperature=1.0, top_p=1.0, top_k=500)
    keys = mx.stack([mx.random.key(s) for s in (11, 0, 0, 0)])
    seeded = mx.array([True, False, False, False])
    tokens, _ = sampling.sample(logits, t, p, k, m, keys, seeded)
    alone, _ = sampling.sample(logits[:1], t[:1], p[:1], k[:1], m[:1], keys[:1], seeded[:1])
    again, _ = sampling.sample(logits, t, p, k, m, keys, seeded)
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


def test_min_p_keeps_only_tokens_near_the_most_likely():
    # Row logits: token 0 at 0, token 1 at log(0.5), the rest far below. min_p 0.4 keeps 0 and 1.
    logits = mx.concatenate([mx.array([[0.0, math.log(0.5)]]), mx.full((1, 98), -20.0)], axis=1)
    logits = mx.repeat(logits, 64, axis=0)
    keys, seeded = mx.stack([mx.random.key(i) for i in range(64)]), mx.ones((64,), mx.bool_)
    kept, _ = sampling.sample(logits, *_sample_args(64, 100, 1.0, 1.0, 100, 0.4), keys, seeded)
    assert set(kept.tolist()) == {0, 1}
    only_top, _ = sampling.sample(logits, *_sample_args(64, 100, 1.0, 1.0, 100, 0.6), keys, seeded)
    assert set(only_top.tolist()) == {0}


def test_processors_apply_bias_mask_and_repetition_penalty():
    logits = mx.array([[2.0, -2.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5]])
    bias = mx.array([[0.0, 0.0, 5.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    allowed = mx.array([[-1], [0b1010]], mx.int32)  # row 1: tokens 1 and 3 only
    seen = mx.array([[True, True, False, False], [False, False, False, False]])
    out = sampling.process(logits, bias, allowed, mx.array([2.0, 1.0]), seen)
    assert out[0].tolist() == [1.0, -4.0, 6.0, 0.5]  # 2/2, -2*2, 1+5, untouched
    assert out[1].tolist() == [-math.inf, -2.0, -math.inf, 0.5]


def test_logprobs_are_sorted_and_normalised():
    logits = mx.random.normal((3, 200)) * 3
    greedy = sampling.greedy(logits)
    chosen, top_ids, top_lp = sampling.logprobs(logits, greedy)
    assert mx.array_equal(top_ids[:, 0], greedy)
    assert mx.allclose(chosen, top_lp[:, 0])
    assert (top_lp[:, :-1] >= top_lp[:, 1:]).all().item()
    assert (mx.exp(top_lp).sum(axis=-1) <= 1.0 + 1e-5).all().item()
