"""Speculative decoding on tiny random models: the verify step scores every position as decode
steps do; greedy and seeded rows get exactly the tokens of plain decoding with either proposer,
alone and in mixed batches (penalties, logprobs, stop tokens), across capacity-bucket moves; a
model drafting for itself has every proposal accepted; and sampled rows keep the target
distribution (chi-square tests, seeded, so they do not flake)."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from models import llama, speculative
from models.loader import LoadedModel, ModelLoadError
from models.sampling import filter_logits
from service.config import ConfigError, load_settings
from service.engine.buckets import BucketTable
from service.engine.core import Engine
from service.engine.lookup import NgramIndex, PromptLookup
from service.engine.sequence import SamplingParams, Sequence
from service.engine.speculative import Speculator
from service.engine.warmup import WarmupSpec
from service.metrics import Metrics
from service.process.memory import worst_case
from service.process.startup import MemoryBudgetError, check_memory, draft_name, load_models
from tests.support import (
    ATOL,
    TINY,
    WordTokenizer,
    engine_at,
    new_cache,
    prefill_one,
    random_params,
    serve_all,
    start_engine,
    write_dir,
)

BUCKETS = BucketTable(batch=(1, 2, 4), prompt=(8, 16), capacity=(16, 32, 64))


def varied(seed: int) -> dict:
    """A tiny random model with an untied output head (tied, it mostly repeats its input)."""
    params = random_params(seed=seed)
    params["lm_head"] = {"weight": mx.random.normal((TINY.vocab_size, TINY.hidden_size)) * 0.5}
    mx.eval(params)
    return params


@pytest.fixture(scope="module")
def params() -> dict:
    return varied(0)


def perturbed(params: dict, scale: float) -> dict:
    """A draft that agrees with ``params`` often but not always: its output head plus noise."""
    mx.random.seed(1)
    head = params["lm_head"]["weight"]
    return {**params, "lm_head": {"weight": head + scale * mx.random.normal(head.shape)}}


def make_engine(params, method: str | None = None, draft: dict | None = None, k: int = 3) -> tuple[Engine, Metrics]:
    model = LoadedModel("tiny", Path("-"), TINY, params, WordTokenizer(frozenset()), mx.float32, "dequantized", 0.0)
    metrics = Metrics(CollectorRegistry(), version="test", device="cpu")
    d = None
    if method == "draft":
        tokenizer = WordTokenizer(frozenset())
        d = LoadedModel("tiny/draft", Path("-"), TINY, draft, tokenizer, mx.float32, "dequantized", 0.0)
    speculation = {} if method is None else {"speculative": method, "speculative_tokens": k, "speculative_max_batch": 4}
    engine = engine_at(model, BUCKETS, metrics, d, prefill_chunk_tokens=8, max_batched_tokens=16, **speculation)
    engine.ready.set()  # record metrics (nothing else reads it when stepping by hand)
    return engine, metrics


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[Sequence]:
    """Submit every request at once and step the engine by hand until all have ended."""
    seqs = [Sequence(p, s, engine.model.tokenizer.detokenizer(), lambda e: None) for p, s in requests]
    for seq in seqs:
        engine.submit(seq)
    while not all(s.finish_reason for s in seqs) or engine.runner.busy:
        engine.step()
    return seqs


def counter(metrics: Metrics, name: str, method: str) -> float:
    labels = {"model": "tiny", "method": method}
    return metrics.registry.get_sample_value(f"stepserve_speculative_{name}_tokens_total", labels) or 0.0


def test_verify_scores_every_position_as_decode_steps_do(params):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    tokens = mx.array([[11, 12, 13, 14], [21, 22, 23, 24]], mx.int32)  # newest token, then 3 proposals
    kv = new_cache(2, 16, fill=3.0)  # garbage past each row's prefix must never be read
    for b, prompt in enumerate(prompts):
        _, row = prefill_one(params, prompt)
        for layer in range(len(kv.keys)):
            kv.keys[layer][b, :, : len(prompt)] = row.keys[layer][0]
            kv.values[layer][b, :, : len(prompt)] = row.values[layer][0]
    positions = mx.array([len(p) for p in prompts], mx.int32)
    logits, _ = llama.verify(params, tokens, positions, kv, args=TINY)
    for b, prompt in enumerate(prompts):
        for j in range(4):
            expected, _ = prefill_one(params, prompt + tokens[b, : j + 1].tolist())
            assert mx.allclose(logits[b, j], expected, atol=ATOL), (b, j)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    index = NgramIndex()
    index.extend([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6])
    assert index.propose(3) == [7, 9, 2]  # "5 6" last seen before the suffix, followed by 7 9 2
    index.extend([7])
    assert index.propose(2) == [9, 2]  # "5 6 7": the latest earlier occurrence wins
    assert NgramIndex().propose(3) == []


class Repeater:
    """A scripted row's model: the next token is the one prompt lookup would guess first with
    probability ``p`` (a seeded coin per position), else another of ``vocab`` tokens. Over a
    small vocabulary every suffix recurs, so lookup proposes at nearly every step; ``p = 0``: a
    row whose proposals always fail, ``p = 1``: one that copies."""

    def __init__(self, p: float, seed: int = 0, vocab: int = 6) -> None:
        self.p, self.seed, self.vocab, self.index = p, seed, vocab, NgramIndex()

    def next(self, tokens: list[int]) -> int:
        self.index.extend(tokens[len(self.index.tokens) :])
        guess = self.index.propose(1)
        coin = random.Random(self.seed * 1_000_003 + len(tokens))
        if guess and coin.random() < self.p:
            return guess[0]
        return guess[0] % self.vocab + 1 if guess else coin.randrange(1, self.vocab + 1)


class StepRegistry:
    """Where a speculator registers its step functions; the scripted policy runs none of them."""

    def register(self, phase, spec) -> None:
        pass


class CountingLookup(PromptLookup):
    proposals = 0  # calls that proposed something

    def propose(self, request_id: str, prompt: list[int], output: list[int], k: int) -> list[int]:
        guess = super().propose(request_id, prompt, output, k)
        self.proposals += bool(guess)
        return guess


def decode_scripted(
    model: Repeater, ratio: float, lookup: PromptLookup | None = None, steps: int = 256
) -> tuple[int, int, int]:
    """Decode one row for ``steps`` steps under the speculator's policy, a verify step costing
    ``ratio`` plain steps (batch bucket 1, K = 4), each verify step greedy (proposals accepted
    while they are the model's tokens, then its own). Returns (plain steps, verify steps, tokens)."""
    buckets = BucketTable(batch=(1,), prompt=(16,), capacity=(1 << 30,))  # no capacity limit in sight
    spec = Speculator(
        lookup or PromptLookup(), StepRegistry(), None, buckets, tokens=4, ratios={1: ratio}, calibration={"b1": {}}
    )
    prompt = [1, 2, 3, 4, 5, 6, 1, 3, 5, 2, 4, 6]
    seq = Sequence(prompt, SamplingParams(max_tokens=10 * steps), WordTokenizer(frozenset()).detokenizer(), print)
    plain = verify = 0
    for _ in range(steps):
        plan = spec.plan_rows([seq])
        if plan is None:
            seq.output_ids.append(model.next(prompt + seq.output_ids))
            plain += 1
            continue
        guess = plan[seq.request_id]
        assert isinstance(guess, list)
        verify += 1
        for j in range(len(guess) + 1):
            seq.output_ids.append(model.next(prompt + seq.output_ids))
            if j == len(guess) or seq.output_ids[-1] != guess[j]:
                spec.verified(seq.request_id, len(guess), j)
                break
    return plain, verify, len(seq.output_ids)


@pytest.mark.parametrize("ratio", [1.05, 1.5, 3.0])
def test_a_row_whose_proposals_always_fail_triggers_no_verify_step(ratio):
    lookup = CountingLookup()
    plain, verify, _ = decode_scripted(Repeater(p=0.0), ratio, lookup)
    assert (plain, verify) == (256, 0)
    assert lookup.proposals > 200  # it proposed (and was wrong) at nearly every step


@pytest.mark.parametrize("p", [0.3, 0.5, 0.7, 0.85])
@pytest.mark.parametrize("ratio", [1.2, 2.0, 3.0])
def test_verify_steps_cost_a_row_at_most_two_percent_whatever_its_acceptance(p, ratio):
    """Middling, noisy acceptance (a row that sometimes repeats itself), with the cost of a
    verify step near what it yields: the time lost to verify steps net of their tokens is at
    most 2% of the plain steps' time and one verify step's extra cost (the module's bound)."""
    for seed in range(3):
        plain, verify, tokens = decode_scripted(Repeater(p, seed), ratio)
        lost = plain + ratio * verify - tokens  # plain steps give one token each
        assert lost <= 0.02 * plain + (ratio - 1) + 1e-9, (seed, plain, verify, tokens)


@pytest.mark.parametrize("ratio", [1.2, 3.0])
def test_a_copying_row_speculates(ratio):
    plain, verify, tokens = decode_scripted(Repeater(p=1.0), ratio)
    assert verify > 0.8 * (plain + verify)  # verified from its first few steps on
    assert tokens / (plain + ratio * verify) > 4.5 / ratio  # K + 1 = 5 tokens a verify step, less the start


def mixed_requests(reference_stop: int | None = None) -> list[tuple[list[int], SamplingParams]]:
    """Greedy rows long enough to cross capacity buckets 16 and 32, a seeded sampled row, a
    penalised row, a logprobs row and (given) one that stops on a token."""
    requests = [
        ([1, 2, 3, 4, 1, 2, 3], SamplingParams(max_tokens=40, seed=3)),  # greedy, seeded: its key stays
        ([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=36)),
        ([9, 9, 8], SamplingParams(max_tokens=30, temperature=0.9, top_k=20, seed=7)),
        ([3, 4, 5], SamplingParams(max_tokens=12, presence_penalty=1.5)),
        ([7, 1, 7, 1, 7], SamplingParams(max_tokens=10, logprobs=2)),
        (list(range(30, 42)), SamplingParams(max_tokens=60)),  # stops at the largest capacity (64)
    ]
    if reference_stop is not None:
        requests.append(([1, 2, 3, 4, 1, 2, 3], SamplingParams(max_tokens=40, stop_token_ids=(reference_stop,))))
    return requests


@pytest.mark.parametrize("method", ["lookup", "draft-self", "draft-other"])
def test_tokens_are_those_of_plain_decoding(params, method):
    plain_engine, _ = make_engine(params)
    first = run(plain_engine, mixed_requests()[:1])[0].output_ids
    requests = mixed_requests(reference_stop=first[9])
    plain = run(make_engine(params)[0], requests)
    draft = {"draft-self": params, "draft-other": perturbed(params, 0.4)}.get(method)
    engine, metrics = make_engine(params, method.split("-")[0], draft)
    spec = run(engine, requests)
    for a, b in zip(plain, spec, strict=True):
        assert b.output_ids == a.output_ids, f"{a.params}: plain {a.output_ids}, speculative {b.output_ids}"
        assert b.finish_reason == a.finish_reason
    assert spec[-1].output_ids[-1] == first[9] and len(spec[-1].output_ids) == 10
    assert [e.token_id for e in spec[4].logprob_entries] == [e.token_id for e in plain[4].logprob_entries]
    name = method.split("-")[0]
    proposed, accepted = counter(metrics, "proposed", name), counter(metrics, "accepted", name)
    assert proposed > 0 and accepted > 0
    if method == "draft-self":
        assert accepted == proposed  # a model drafting for itself is always right
    else:
        assert accepted < proposed  # some proposals were rejected and rolled back
    moves = metrics.registry.get_sample_value("stepserve_bucket_moves_total", {"model": "tiny", "kind": "capacity"})
    assert moves and moves >= 2


def p_value(observed: Counter, expected: dict[int, float], n: int) -> float:
    """Chi-square goodness of fit (categories with an expected count under 5 pooled), the
    p-value by the Wilson-Hilferty approximation (Wilson and Hilferty 1931)."""
    big = {t for t, p in expected.items() if p * n >= 5}
    cells = [(observed[t], expected[t] * n) for t in big]
    rest = n - sum(o for o, _ in cells), n * (1 - sum(expected[t] for t in big))
    if rest[1] > 0:
        cells.append(rest)
    stat, df = sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_acceptance_keeps_the_target_distribution():
    """spec_accept on fixed logits for 4,000 rows with their own keys: the first token emitted is
    distributed as the target p, whatever the draft q, by rejection sampling and by matching."""
    mx.random.seed(11)
    V, K, n = 12, 2, 4000
    target = mx.random.normal((1, K + 1, V)) * 1.5
    draft_logits = mx.random.normal((K, V)) * 1.5
    ones = mx.ones((n,))
    params = (ones * 0.8, ones * 0.9, mx.full((n,), 8, mx.int32), ones * 0)  # temperature, top-p, top-k, min-p
    q = mx.softmax(filter_logits(draft_logits, *(a[:K] for a in params)), axis=-1)
    proposals = mx.random.categorical(mx.log(q), num_samples=n).T.astype(mx.int32)  # [n, K], drawn from q
    noise, _, extra = speculative.spec_keys(mx.zeros((n, 2), mx.uint32), mx.zeros((n,), mx.bool_), mx.zeros((K + 1,)))
    logits = mx.broadcast_to(target, (n, K + 1, V))
    q_rows = mx.broadcast_to(q, (n, K, V))
    y, accept, residual = speculative.spec_accept(logits, proposals, q_rows, *params, noise, extra)
    p = mx.softmax(filter_logits(target[0], *(a[: K + 1] for a in params)), axis=-1).tolist()
    y_l, a_l, r_l, d_l = y.tolist(), accept.tolist(), residual.tolist(), proposals.tolist()
    rejection = [speculative.take_prefix(y_l[i], d_l[i], K, a_l[i], r_l[i]) for i in range(n)]
    lookup = [speculative.take_prefix(y_l[i], [int(np.argmax(p[0]))] * K, K) for i in range(n)]
    for emitted in (rejection, lookup):
        assert p_value(Counter(e[0] for e in emitted), dict(enumerate(p[0])), n) > 1e-3
        seconds = [e[1] for e in emitted if len(e) > 1]  # after an accepted first proposal
        assert p_value(Counter(seconds), dict(enumerate(p[1])), len(seconds)) > 1e-3
    assert 0.2 < sum(len(e) > 1 for e in rejection) / n < 0.95  # both branches ran


def test_sampled_outputs_keep_the_target_distribution_with_a_draft(params):
    """300 unseeded requests (rejection sampling against another tiny model's drafts): the
    frequencies of their second token fit the target's exact marginal, as plain decoding's do."""
    mx.random.seed(5)
    prompt, sampling = [4, 8, 15, 16], SamplingParams(max_tokens=3, temperature=1.0, top_k=5)
    filt = (mx.array([1.0]), mx.array([1.0]), mx.array([5], mx.int32), mx.array([0.0]))

    def dist(ids):
        return mx.softmax(filter_logits(prefill_one(params, ids)[0][None], *filt), axis=-1)[0].tolist()

    first = dist(prompt)
    marginal: dict[int, float] = {}
    for x, px in enumerate(first):
        if px > 0:
            for t, pt in enumerate(dist(prompt + [x])):
                marginal[t] = marginal.get(t, 0.0) + px * pt
    for method in ("draft", None):
        engine, metrics = make_engine(params, method, perturbed(params, 0.4), k=2)
        seconds = [s.output_ids[1] for _ in range(75) for s in run(engine, [(prompt, sampling)] * 4)]
        assert p_value(Counter(seconds), marginal, len(seconds)) > 1e-3, method
        if method:
            assert 0 < counter(metrics, "accepted", method) < counter(metrics, "proposed", method)


def test_speculative_settings_are_checked(tmp_path):
    config = tmp_path / "stepserve.toml"
    config.write_text('[[models]]\nname = "a"\nspeculative = "draft"\n')
    with pytest.raises(ConfigError, match="model 'a': speculative = 'draft' needs draft_model"):
        load_settings(config)
    config.write_text('draft_model = "/m"\n')
    with pytest.raises(ConfigError, match="draft_model is set but speculative is 'off'"):
        load_settings(config)
    with pytest.raises(ConfigError, match="speculative_tokens"):
        load_settings(speculative="lookup", speculative_tokens=0)
    assert load_settings().served_models()[0].speculative == "off"  # the default (docs/BENCHMARKS.md)
    spec = load_settings(speculative="lookup", speculative_tokens=2).served_models()[0]
    assert (spec.speculative, spec.speculative_tokens, spec.speculative_max_batch) == ("lookup", 2, None)
    assert load_settings(speculative="off").served_models()[0].speculative == "off"
    assert (
        load_settings(speculative="lookup", distributed=True).served_models()[0].speculative == "off"
    )  # a verify step is one process's


@pytest.mark.parametrize("method", ["lookup", "draft"])
def test_warm_up_calibrates_and_compiles_every_verify_step(params, method):
    """The engine's warm-up (the calibration, or a configured batch limit; verify and draft steps;
    the rehearsal) leaves nothing to compile: requests after ready miss no compiled step."""
    misses: list[tuple[str, str, str]] = []
    model = LoadedModel("tiny", Path("-"), TINY, params, WordTokenizer(frozenset()), mx.float32, "dequantized", 0.0)
    metrics = Metrics(CollectorRegistry(), version="t", device="cpu")
    metrics.record_lookup = lambda m, p, b, hit: None if hit else misses.append((m, p, b))  # type: ignore[method-assign]
    draft = LoadedModel("tiny/draft", Path("-"), TINY, params, model.tokenizer, mx.float32, "dequantized", 0.0)
    engine = engine_at(
        model,
        BUCKETS,
        metrics,
        draft if method == "draft" else None,
        prefill_chunk_tokens=8,
        speculative=method,
        speculative_tokens=2,
        speculative_max_batch=None if method == "lookup" else 2,
    )
    speculator = engine.speculator
    assert speculator is not None
    start_engine(engine, WarmupSpec(prompt_tokens=16, batch=2, chunk_tokens=8, max_batched_tokens=16))
    try:
        assert engine.ready.wait(120)
        assert set(speculator.calibration) == {"b1", "b2"}
        assert any(k.startswith("verify b1x3c") for k in engine.compile_choices())
        before = len(misses)
        requests = [
            ([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=20, seed=i, temperature=0.5 * i)) for i in range(2)
        ]
        seqs = [Sequence(p, s, model.tokenizer.detokenizer(), lambda e: None) for p, s in requests]
        serve_all(engine, seqs, idle=False)
        assert all(s.finish_reason for s in seqs)
        assert misses[before:] == []
        if method == "draft":  # (lookup's buckets speculate or not as this CPU measured them)
            steps = next(m for m in metrics.registry.collect() if m.name == "stepserve_step_seconds").samples
            assert any(x.labels["phase"] == "verify" and x.name.endswith("_count") and x.value for x in steps)
    finally:
        engine.stop()


def test_the_start_up_memory_check_counts_a_draft(tmp_path, params):
    model = LoadedModel("m", Path("-"), TINY, params, None, mx.float32, "dequantized", 0.0)
    draft = LoadedModel(draft_name("m"), Path("-"), TINY, params, None, mx.float32, "dequantized", 0.0)
    common = {"model_name": "m", "batch_buckets": [1], "prompt_buckets": [32], "capacity_buckets": [256]}
    settings = load_settings(**common, max_sequences=1, speculative="draft", draft_model=tmp_path)
    alone = worst_case(model, BucketTable((1,), (32,), (256,)), 1, 512, 2048, 0).total
    budget = settings.model_copy(update={"memory_budget_bytes": alone + settings.prefix_cache_bytes})
    assert check_memory(budget, {"m": model}).max_sequences == 1  # it fits without its draft
    with pytest.raises(MemoryBudgetError, match="m/draft"):  # not with it
        check_memory(budget, {"m": model, "m/draft": draft})


def test_a_model_with_sliding_window_layers_decodes_without_lookup_and_refuses_a_draft(tmp_path):
    # Its decode cache holds rings for the sliding layers, which a verify step's several tokens
    # per row cannot be written into: prompt lookup is left off for it, and a draft
    # is refused at start-up rather than served wrong.
    write_dir(tmp_path / "m", model_keys={"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]})
    settings = load_settings(model=str(tmp_path / "m"), speculative="lookup")
    assert settings.served_models()[0].speculative == "lookup"
    assert load_models(settings)[settings.model_name].args.windows is not None  # loads (the builder skips lookup)
    drafted = dict(model=str(tmp_path / "m"), speculative="draft", draft_model=tmp_path / "m")
    with pytest.raises(ModelLoadError, match=r"not implemented for models with sliding.*set kv_cache = 'paged'"):
        load_models(load_settings(**drafted))
    # on the paged pool a verify step sees each row linearly (the window a mask): a draft is served
    paged = load_settings(**drafted, kv_cache="paged")
    assert set(load_models(paged)) == {paged.model_name, draft_name(paged.model_name)}
