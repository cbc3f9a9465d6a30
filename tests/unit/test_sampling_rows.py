"""Per-row sampling features inside the engine's batched steps, on a tiny random model: the n
choices of one prompt share its prefill, a logit bias and the penalties act on their rows only
(and see each token before the next is chosen), and logprobs describe the model's own
distribution."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from models.loader import LoadedModel
from service.engine.buckets import BucketTable
from service.engine.core import Engine
from service.engine.processors import ProcessorInputs
from service.engine.sequence import FinalEvent, SamplingParams, Sequence, TokenEvent
from tests.support import TINY, WordTokenizer, engine_at, prefill_one, random_params

BUCKETS = BucketTable(batch=(1, 2, 4), prompt=(8, 16), capacity=(32,))
PROMPT = [5, 9, 2, 7, 3]


@pytest.fixture
def engine() -> Engine:
    model = LoadedModel(
        "tiny", Path("-"), TINY, random_params(), WordTokenizer(frozenset()), mx.float32, "dequantized", 0.0
    )
    return engine_at(model, BUCKETS)


def run(engine: Engine, params: list[SamplingParams]) -> list[list]:
    """Submit one request per params (same prompt), step until all end; each one's events."""
    events: list[list] = [[] for _ in params]
    seqs = [
        Sequence(list(PROMPT), p, engine.model.tokenizer.detokenizer(), events[i].append) for i, p in enumerate(params)
    ]
    for seq in seqs:
        engine.submit(seq)
    while not all(any(isinstance(e, FinalEvent) for e in ev) for ev in events):
        engine.step()
    while engine.runner.busy:
        engine.step()
    return [[s.output_ids for s in seqs][i] for i in range(len(seqs))], events  # type: ignore[return-value]


def test_choices_of_one_prompt_share_one_prefill_row(engine):
    stats = []
    original = engine.prefiller.run

    def spy(seqs):
        out = original(seqs)
        stats.extend(out.steps)
        return out

    engine.prefiller.run = spy  # type: ignore[method-assign]
    outputs, _ = run(engine, [SamplingParams(max_tokens=4, temperature=0.0)] * 3)
    assert outputs[0] == outputs[1] == outputs[2]
    assert [(s.phase, s.rows) for s in stats] == [("prefill", 1)]  # three requests, one prompt row


def test_logit_bias_and_penalties_act_on_their_rows_only(engine):
    free = SamplingParams(max_tokens=6)
    (alone,), _ = run(engine, [free])
    forced = SamplingParams(max_tokens=6, logit_bias=((11, 100.0),))
    penalised = SamplingParams(max_tokens=6, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=5.0)
    (a, b, c), _ = run(engine, [free, forced, penalised])
    assert a == alone  # a free row beside processed rows is unchanged
    assert b == [11] * 6
    assert c != alone


def test_logprobs_are_the_models_distribution_sorted(engine):
    (out,), (events,) = run(engine, [SamplingParams(max_tokens=5, logprobs=3)])
    entries = [e for ev in events if isinstance(ev, TokenEvent) for e in ev.logprobs]
    assert [e.token_id for e in entries] == out[: len(entries)] and entries
    for e in entries:
        lps = [lp for _, lp in e.top]
        assert len(lps) == 3 and lps == sorted(lps, reverse=True)
        assert e.top[0][0] == e.token_id and np.isclose(e.logprob, lps[0], atol=1e-5)  # greedy: the top token


def penalised_reference(params, n: int, presence: float, frequency: float) -> list[int]:
    """Greedy tokens of PROMPT alone with OpenAI's presence and frequency penalties over the
    tokens generated so far, one full forward pass per token (no pipelining)."""
    out: list[int] = []
    for _ in range(n):
        logits, _ = prefill_one(params, PROMPT + out)
        counts = np.bincount(np.asarray(out, np.int64), minlength=TINY.vocab_size)
        adjusted = np.array(logits) - presence * (counts > 0) - frequency * counts
        out.append(int(np.argmax(adjusted)))
    return out


def test_penalties_see_every_token_before_the_next_is_chosen(engine):
    # The engine queues a penalised row's forward pass before reading its previous token back;
    # the penalty must still count that token (a one-step lag would change these tokens).
    penalised = SamplingParams(max_tokens=16, presence_penalty=2.0, frequency_penalty=2.0)
    (free_out, out), _ = run(engine, [SamplingParams(max_tokens=16), penalised])
    expected = penalised_reference(engine.model.params, 16, 2.0, 2.0)
    assert len(set(expected)) > 1  # the penalties change the greedy token part way through
    assert out == expected
    (alone,), _ = run(engine, [SamplingParams(max_tokens=16)])
    assert free_out == alone


def test_processor_inputs_send_only_what_rows_use():
    inputs = ProcessorInputs(TINY.vocab_size)
    bias_row = Sequence([1, 2], SamplingParams(logit_bias=((3, 2.0),), presence_penalty=1.0), None, lambda e: None)
    bias_row.sampled_ids = [4, 4]
    repeat_row = Sequence([5], SamplingParams(repetition_penalty=1.2), None, lambda e: None)
    (bias, allowed, repetition, seen), masks, _ = inputs.build([None, bias_row], 2)
    neutral = inputs.neutral(2)
    assert masks == 0 and allowed is neutral[1] and repetition is neutral[2] and seen is neutral[3]
    expected = np.zeros((2, TINY.vocab_size), np.float32)
    expected[1, 3], expected[1, 4] = 2.0, -1.0
    assert np.array_equal(np.array(bias), expected)
    (bias, _, repetition, seen), _, _ = inputs.build([repeat_row, None], 2)
    assert bias is neutral[0]
    assert np.allclose(np.array(repetition), [1.2, 1.0])
    assert np.flatnonzero(np.array(seen)).tolist() == [5]
