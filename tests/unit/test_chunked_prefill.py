"""Chunked prefill and prefix-cache hits on the real default model (float32, CPU): a long
prompt prefilled in chunks, or continued from cached blocks, gives the logits and greedy tokens
of the same prompt prefilled whole."""

import mlx.core as mx
import pytest

from models.default import default_model_path
from models.kv_cache import KVCache
from models.llama import decode, prefill, prefill_chunk
from models.loader import load_model
from service.engine.buckets import BucketTable
from service.engine.prefix_cache import PrefixCache
from tests.support import ON_GPU, engine_at

TOL = 3e-2 if ON_GPU else 1e-3
STEPS = 4
TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how "
    "books were made and who could read them. "
)


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_path(), "smol", mx.float32, "dequantized")


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:
    ids = model.tokenizer.encode(TEXT * 12)
    assert 300 < len(ids) < 500
    return ids


@pytest.fixture(scope="module")
def prompt_whole(model, prompt):
    """:func:`whole` of ``prompt``, the reference of the tests below, computed once (it is the
    same deterministic prefill and decode for each)."""
    return whole(model, prompt)


def cache(model, capacity: int) -> KVCache:
    a = model.args
    return KVCache.allocate(a.num_hidden_layers, 1, a.num_key_value_heads, capacity, a.dim_per_head, mx.float32)


def greedy_after(model, logits: mx.array, kv: KVCache, position: int) -> tuple[list[int], list[mx.array]]:
    """STEPS greedy tokens decoded after a prefill whose last logits are ``logits`` [1, V]."""
    tokens, history = [], [logits[0]]
    for i in range(STEPS):
        tokens.append(int(mx.argmax(logits[0])))
        logits, kv = decode(
            model.params, mx.array([tokens[-1]], mx.int32), mx.array([position + i]), kv, args=model.args
        )
        history.append(logits[0])
    return tokens, history


def whole(model, ids: list[int]):
    logits, kv = prefill(
        model.params, mx.array([ids], mx.int32), mx.array([len(ids)]), cache(model, len(ids)), args=model.args
    )
    return greedy_after(model, logits, kv.resized(1024), len(ids))


def chunked(model, ids: list[int], chunk: int, kv: KVCache, start: int = 0):
    """Prefill ids[start:] in chunks of ``chunk`` (the last one padded) on top of ``kv``."""
    a, logits = model.args, None
    for offset in range(start, len(ids), chunk):
        part = ids[offset : offset + chunk]
        tokens = mx.array([part + [0] * (chunk - len(part))], mx.int32)
        logits, kv = prefill_chunk(model.params, tokens, mx.array([offset]), mx.array([len(part)]), kv, args=a)
    return greedy_after(model, logits, kv, len(ids))


def assert_same(got, expected):
    (tokens, logits), (ref_tokens, ref_logits) = got, expected
    assert tokens == ref_tokens
    worst = max(mx.abs(x - y).max().item() for x, y in zip(logits, ref_logits, strict=True))
    print(f"max |logit diff| {worst:.2e}")
    assert worst < TOL


@pytest.mark.parametrize("chunk", [64, 128])
def test_a_prompt_prefilled_in_chunks_matches_it_prefilled_whole(model, prompt, prompt_whole, chunk):
    assert_same(chunked(model, prompt, chunk, cache(model, 1024)), prompt_whole)


def test_a_prefix_cache_hit_matches_the_whole_prefill(model, prompt, prompt_whole):
    prefix = PrefixCache(block_tokens=32, budget_bytes=10**9)
    first = prompt[:200]
    _, kv = prefill(model.params, mx.array([first], mx.int32), mx.array([200]), cache(model, 256), args=model.args)
    assert prefix.insert(first, kv) == 6  # 6 whole blocks of 32
    hit = prefix.match(prompt)
    assert hit.num_tokens == 192
    staged = prefix.gather(hit).resized(1024)
    assert_same(chunked(model, prompt, 128, staged, start=192), prompt_whole)


def test_hits_whose_last_chunks_run_in_one_call_match_each_prefilled_whole(model, prompt):
    """The engine runs the last chunks of several prompts (here prefix-cache hits of one shared
    prefix with tails of different lengths) as one call padded to a batch bucket
    (:meth:`Executor.chunk_rows`): each row's logits and greedy tokens are its prompt's own."""
    prefix = PrefixCache(block_tokens=32, budget_bytes=10**9)
    shared = prompt[:200]
    _, kv = prefill(model.params, mx.array([shared], mx.int32), mx.array([200]), cache(model, 256), args=model.args)
    prefix.insert(shared, kv)
    tails = [model.tokenizer.encode(f" Question {i}: " + "why?" * (1 + 3 * i)) for i in range(3)]
    prompts = [shared + tail for tail in tails]
    executor = engine_at(model, BucketTable(batch=(4,), prompt=(64,), capacity=(256,))).executor
    executor.batches_chunks = True  # as on a GPU (a CPU runs chunks one by one)
    staged, tokens, offsets, lengths = [], [], [], []
    for ids in prompts:
        hit = prefix.match(ids)
        assert hit.num_tokens == 192
        staged.append(prefix.gather(hit, 256))
        rest = ids[192:]
        tokens.append(rest + [0] * (64 - len(rest)))
        offsets.append(192)
        lengths.append(len(rest))
    logits, batched = executor.chunk_rows(staged, tokens, offsets, lengths, batch=4)
    assert logits.shape[0] == 4 and batched.batch == 4
    for i, ids in enumerate(prompts):
        row = KVCache([k[i : i + 1] for k in batched.keys], [v[i : i + 1] for v in batched.values])
        assert_same(greedy_after(model, logits[i : i + 1], row, len(ids)), whole(model, ids))
