"""A prompt encoded piece by piece between added tokens, long pieces reused, has the ids of the
prompt encoded whole; tokenizers whose pieces are not independent get no such encoder."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from models import segments
from models.default import default_model_path
from models.gguf.header import read_gguf_header
from models.gguf.reader import read_gguf
from models.gguf.vocab import tokenizer_from_gguf
from models.segments import SegmentEncoder
from models.tokenizer import ChatTokenizer
from service.bench.prompts import system_prompt
from tests.support import gemma_gguf

_FRAGMENTS = [
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    " \n ",
    "word",
    " word",
    "Word's",
    "12345",
    " 7",
    "é",
    "日本語",
    "🙂",
    "<",
    "|",
    "<|im_",
    "<b>",
    "[",
    "'s",
    "x",
]


@pytest.fixture(scope="module")
def smollm() -> ChatTokenizer:
    _, metadata = read_gguf(default_model_path())
    return tokenizer_from_gguf(metadata)


@pytest.fixture(scope="module")
def gemma() -> ChatTokenizer:
    header = read_gguf_header(gemma_gguf())
    return tokenizer_from_gguf(header.metadata, gemma_gguf())


def _texts(tok: ChatTokenizer, seed: int, count: int) -> list[str]:
    """Random texts of added tokens, whitespace and word fragments around long passages (each
    passage comes back in later texts, so the reused ids are exercised too)."""
    rng = random.Random(seed)
    added = [t.content for t in tok.tokenizer.get_added_tokens_decoder().values()]
    passages = [system_prompt(n) for n in (200, 400, 1500)]
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            roll = rng.random()
            if roll < 0.3:
                parts.append(rng.choice(added))
            elif roll < 0.45:
                parts.append(rng.choice(passages))
            else:
                parts.append("".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(1, 6))))
        texts.append("".join(parts))
    return texts


@pytest.mark.parametrize("name", ["smollm", "gemma"])
def test_pieces_give_the_ids_of_the_whole_text(name, request):
    tok: ChatTokenizer = request.getfixturevalue(name)
    encoder = tok.segments
    assert encoder is not None
    encoder.hits = encoder.misses = 0
    for text in _texts(tok, seed=12, count=300):
        assert encoder.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids, text[:200]
    assert encoder.hits > 20 and encoder.misses > 0  # long passages were kept and found again


def test_a_chat_with_a_shared_system_prompt(smollm):
    system = system_prompt(1500)
    for question in ("What is 2+2?", " leading space", "tabs\tand\nnewlines  ", ""):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        text = smollm.apply_chat_template(messages)
        assert smollm.encode(text) == smollm.tokenizer.encode(text, add_special_tokens=False).ids


def _word_level(pre: pre_tokenizers.PreTokenizer, added: AddedToken) -> Tokenizer:
    vocab = {"▁a": 0, "a": 1, "<s>": 2, "?": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre
    tok.add_special_tokens([added])
    return tok


def test_metaspace_first_pieces_are_not_independent():
    tok = _word_level(pre_tokenizers.Metaspace(prepend_scheme="first"), AddedToken("<s>", normalized=False))
    whole = tok.encode("a<s>a", add_special_tokens=False).ids
    by_piece = [*tok.encode("a").ids, 2, *tok.encode("a").ids]
    assert whole == [0, 2, 1] and by_piece == [0, 2, 0]  # ▁ goes only before the text's first piece
    assert SegmentEncoder.build(tok) is None


def test_an_added_token_that_eats_spaces_is_refused():
    plain = _word_level(pre_tokenizers.WhitespaceSplit(), AddedToken("<s>", normalized=False))
    assert SegmentEncoder.build(plain) is not None
    lstrip = _word_level(pre_tokenizers.WhitespaceSplit(), AddedToken("<s>", normalized=False, lstrip=True))
    assert SegmentEncoder.build(lstrip) is None


def test_kept_pieces_stay_within_the_bound(smollm, monkeypatch):
    monkeypatch.setattr(segments, "CACHE_CHARS", 20_000)
    encoder = SegmentEncoder(smollm.tokenizer)
    texts = [f"<|im_start|>{i} {system_prompt(1000)}<|im_end|>" for i in range(12)]
    for text in texts:
        assert encoder.encode(text) == smollm.tokenizer.encode(text, add_special_tokens=False).ids
        assert 0 < encoder._kept_chars <= 20_000
    assert encoder.misses == 12 and encoder.hits == 0
    encoder.encode(texts[-1])
    assert encoder.hits == 1  # the newest is kept, the oldest went first
    encoder.encode(texts[0])
    assert encoder.misses == 13
