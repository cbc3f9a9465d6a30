"""The tokenizer and chat template rebuilt from the default model's GGUF metadata."""

import pytest

from models.default import default_model_path
from models.gguf.reader import read_gguf
from models.gguf.vocab import tokenizer_from_gguf
from models.tokenizer import ChatTokenizer, TokenizerError


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    _, metadata = read_gguf(default_model_path())
    return tokenizer_from_gguf(metadata)


def test_digits_are_single_tokens(tok):
    ids = tok.encode("2026 apples")
    assert [tok.tokenizer.id_to_token(i) for i in ids[:4]] == ["2", "0", "2", "6"]


def test_special_tokens_are_single_ids_and_stop_generation(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.tokenizer.token_to_id("<|im_start|>") and ids[-1] == tok.eos_token_id
    assert tok.tokenizer.token_to_id("<|im_end|>") in tok.stop_token_ids
    assert tok.tokenizer.token_to_id("<|endoftext|>") in tok.stop_token_ids


@pytest.mark.parametrize("text", ["Hello, world!", "héllo 🙂 世界", "  two  spaces\n\n\ttab", "naïve café 3.14159"])
def test_encode_decode_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_incremental_detokenizer_never_emits_partial_characters(tok):
    text = "Ünïcödé 🙂🚀 世界 ok"
    ids = tok.encode(text)
    detok = tok.detokenizer()
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some token ended inside a multi-byte character and was held back


def test_chat_template_renders_with_generation_prompt(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_model_without_template_refuses_messages(tok):
    bare = ChatTokenizer(tok.tokenizer, None, tok.bos_token_id, tok.eos_token_id, False, tok.stop_token_ids)
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
