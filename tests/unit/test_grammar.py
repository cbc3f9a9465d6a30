"""The grammar engine's token masks on the real default tokenizer: a walk that only ever takes
allowed tokens produces JSON valid against the schema; bad schemas are refused by name."""

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from models.default import default_model_path
from models.gguf.reader import read_gguf
from models.gguf.vocab import tokenizer_from_gguf
from models.sampling import unpack_bits
from models.tokenizer import ChatTokenizer
from service.engine.grammar import GrammarError, TokenGrammar

VOCAB = 49152  # SmolLM2-135M's logits width
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user"]},
        "home": {
            "type": "object",
            "properties": {"zip": {"type": "integer", "minimum": 1000, "maximum": 99999}},
            "required": ["zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "home", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    _, metadata = read_gguf(default_model_path())
    return tokenizer_from_gguf(metadata)


@pytest.fixture(scope="module")
def grammars(tok) -> TokenGrammar:
    return TokenGrammar(tok, VOCAB)


def walk(grammar, tok: ChatTokenizer, seed: int, limit: int = 400) -> str:
    """Take allowed tokens until a stop token: a stop once allowed, else often a token that closes
    something (a quote, a brace, a bracket, a digit), else a random allowed one."""
    rng, matcher = np.random.default_rng(seed), grammar.matcher()
    mask = np.zeros((1, (VOCAB + 31) // 32), np.int32)
    out: list[int] = []
    closing = [tok.encode(c)[0] for c in ('"', "}", "]", "1")]
    for _ in range(limit):
        matcher.fill_mask(mask, 0)
        allowed = np.flatnonzero(np.array(unpack_bits(mx.array(mask), VOCAB))[0])
        assert allowed.size and allowed.max() < len(tok.tokenizer.get_vocab())
        stops = [t for t in allowed if t in tok.stop_token_ids]
        if stops and out:
            token = int(stops[0])
        else:
            preferred = [t for t in closing if t in set(allowed.tolist())]
            token = int(preferred[0] if preferred and rng.random() < 0.7 else rng.choice(allowed))
        assert matcher.advance(token)
        if token in tok.stop_token_ids:
            assert matcher.done
            return tok.decode(out)
        out.append(token)
    raise AssertionError("the grammar never let the walk stop")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_walks_of_allowed_tokens_give_schema_valid_json(grammars, tok, seed):
    text = walk(grammars.json_schema(SCHEMA), tok, seed)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_walk_is_an_object(grammars, tok):
    assert isinstance(json.loads(walk(grammars.json_object(), tok, 5)), dict)


def test_a_token_outside_the_grammar_is_refused_without_raising(grammars, tok):
    matcher = grammars.json_object().matcher()
    assert not matcher.advance(tok.encode("hello")[0])


@pytest.mark.parametrize(
    "schema", [{"type": "object", "properties": 5}, {"type": "nonsense"}, {"pattern": "("}, ["not", "an", "object"]]
)
def test_schemas_the_engine_cannot_compile_raise_grammar_error(grammars, schema):
    with pytest.raises(GrammarError):
        grammars.json_schema(schema)  # type: ignore[arg-type]


def test_an_unimplemented_keyword_is_named_and_skipped_when_not_strict(grammars, tok):
    schema = {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}
    with pytest.raises(GrammarError, match="schema: unsupported keyword 'uniqueItems'"):
        grammars.json_schema(schema)
    json.loads(walk(grammars.json_schema(schema, strict=False), tok, 3))


def test_an_invalid_lark_grammar_raises_grammar_error(grammars):
    with pytest.raises(GrammarError, match='grammar: .*unknown name: "undefined_rule"'):
        grammars.lark("start: undefined_rule")


def test_a_lark_grammar_embeds_a_json_schema(grammars, tok):
    lark = 'start: "<tool_call>" %json {"type": "object", "required": ["x"]} "</tool_call>"'
    text = walk(grammars.lark(lark), tok, 4)
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
    assert "x" in json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))


def test_done_only_once_nothing_may_follow(grammars, tok):
    a, stop = tok.encode("a")[0], min(tok.stop_token_ids)
    matcher = grammars.lark('start: "a"+').matcher()
    assert matcher.advance(a) and not matcher.done  # accepting, but more a's may follow
    assert matcher.advance(stop) and matcher.done
    closed = grammars.json_object().matcher()
    assert all(closed.advance(t) for t in tok.encode('{"a": 1}')) and closed.done  # only a stop may follow
    mask = np.zeros((1, grammars.words), np.int32)
    closed.fill_mask(mask, 0)
    assert set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))) == set(tok.stop_token_ids)


def test_ids_past_the_tokenizer_vocabulary_are_never_allowed(tok):
    wide = TokenGrammar(tok, VOCAB + 100)  # a logits width rounded up past the tokenizer's ids
    mask = np.zeros((1, wide.words), np.int32)
    wide.lark(r"start: /[\x00-\xff]*/").matcher().fill_mask(mask, 0)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    assert wide.words == (VOCAB + 100 + 31) // 32 and bits[:VOCAB].sum() > 40000 and not bits[VOCAB:].any()


@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
def test_unpack_bits_matches_numpy_also_compiled(dtype):
    words = np.random.default_rng(0).integers(-(2**31), 2**31 - 1, (3, 5), dtype=np.int64).astype(np.int32)
    expected = np.unpackbits(words.view(np.uint8), bitorder="little").reshape(3, 160)[:, :150].astype(bool)
    words = mx.array(words.view(dtype))
    assert (np.array(unpack_bits(words, 150)) == expected).all()
    assert (np.array(mx.compile(lambda w: unpack_bits(w, 150))(words)) == expected).all()


def test_masks_filled_together_equal_masks_filled_one_by_one(grammars, tok):
    from service.engine.grammar import fill_masks

    a, b = grammars.json_schema(SCHEMA).matcher(), grammars.json_object().matcher()
    assert a.advance(tok.encode("{")[0])
    one = np.zeros((3, (VOCAB + 31) // 32), np.int32)
    a.fill_mask(one, 0)
    b.fill_mask(one, 2)
    together = np.zeros_like(one)
    fill_masks([(a, 0), (b, 2)], together)
    assert (together == one).all() and not together[1].any()


def test_a_schema_sent_again_reuses_its_compiled_grammar_and_each_request_starts_fresh(grammars, tok):
    """Clients send the same few schemas: the second request's schema is not compiled again
    (one with its properties in another order is another grammar: that order is the output's),
    and its matcher starts at the grammar's start whatever the first request's matcher took."""
    first = grammars.json_schema(SCHEMA)
    assert grammars.json_schema(json.loads(json.dumps(SCHEMA))) is first
    assert grammars.json_schema(SCHEMA, strict=False) is not first
    reordered = {**SCHEMA, "properties": dict(reversed(list(SCHEMA["properties"].items())))}
    assert grammars.json_schema(reordered) is not first
    brace = tok.encode("{")[0]
    busy, fresh = first.matcher(), first.matcher()
    assert busy.advance(brace) and not busy.advance(brace)  # "{{" is not JSON
    assert fresh.advance(brace) and first.matcher().advance(brace)  # the others are still at the start
