"""A GGUF file's tokenizer, chat template and stop ids as a :class:`models.tokenizer.ChatTokenizer`.

GGUF stores a byte-level BPE vocabulary (``tokenizer.ggml.model: gpt2``) as
``tokenizer.ggml.tokens`` (id order), ``tokenizer.ggml.merges`` ("a b" strings, rank order)
and ``tokenizer.ggml.token_type`` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte: llama.cpp's ``llama_token_type``). ``tokenizer.ggml.pre`` names the pre-tokenizer;
the regexes below are the ones llama.cpp (llama-vocab.cpp) and the models' own
``tokenizer.json`` use; the BPE tokenizer is built here with ``tokenizers``.

A SentencePiece vocabulary (``tokenizer.ggml.model: llama``, Gemma 3's: tokens, scores and
types, no merges) is rebuilt by transformers' GGUF tokenizer conversion
(``convert_gguf_tokenizer``, which derives the merges and Gemma's normalizer), not here:
an optional dependency, ``pip install 'stepserve[gguf]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from models.errors import ModelLoadError
from models.tokenizer import ChatTokenizer, TokenizerError

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4
#: Architectures whose SentencePiece GGUF vocabulary is rebuilt (tested against the model).
SENTENCEPIECE_ARCHITECTURES = ("gemma3",)
#: Control tokens that end a turn, whatever the GGUF's eos id (llama.cpp's llama-vocab.cpp
#: treats these texts as end-of-turn too).
_STOP_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<end_of_turn>")
GGUF_TOKENIZER_INSTALL = "pip install 'stepserve[gguf]' (transformers' GGUF tokenizer conversion)"


def tokenizer_from_gguf(metadata: dict[str, Any], path: Path | str = "<gguf>") -> ChatTokenizer:
    """The tokenizer, chat template and stop ids in a GGUF file's metadata (values as
    ``mx.load`` or :func:`models.gguf.header.read_gguf_header` return them).

    Raises:
        ModelLoadError: the metadata holds no tokenizer stepserve can rebuild: none at all, no
            EOS token id, a tokenizer model other than byte-level BPE (``gpt2``) or SentencePiece
            (``llama``), an unknown pre-tokenizer, or a SentencePiece vocabulary without
            transformers installed (the message names the file and why).
    """
    try:
        return _chat_tokenizer(metadata, path)
    except (TokenizerError, KeyError) as exc:
        raise ModelLoadError(f"{path}: cannot build the tokenizer ({exc})") from exc


def _chat_tokenizer(metadata: dict[str, Any], path: Path | str) -> ChatTokenizer:
    def get(key: str, default: Any = None) -> Any:
        return _scalar(metadata.get(key, default))

    kind = get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise TokenizerError(
            f"{path}: tokenizer model '{kind}' is not supported; byte-level BPE ('gpt2') or SentencePiece ('llama')"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    raw_types = metadata.get("tokenizer.ggml.token_type")  # int32 array, 1 (normal) when absent
    types = [1] * len(tokens) if raw_types is None else [int(t) for t in _as_list(raw_types)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    specials = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
    if kind == "llama":
        tok = _sentencepiece(metadata, path)
    else:
        tok = _bpe(vocab, metadata["tokenizer.ggml.merges"], str(get("tokenizer.ggml.pre", "gpt2")))
        users = [tokens[i] for i, t in enumerate(types) if t == _USER_DEFINED]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in users])
    eos = get("tokenizer.ggml.eos_token_id")
    if eos is None:
        raise TokenizerError(f"{path}: GGUF metadata has no tokenizer.ggml.eos_token_id")
    stops = {int(eos)}
    stops.update(
        int(get(k)) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if get(k) is not None
    )
    stops.update(vocab[t] for t in _STOP_TEXTS if t in specials)
    bos = get("tokenizer.ggml.bos_token_id")
    return ChatTokenizer(
        tokenizer=tok,
        chat_template=get("tokenizer.chat_template"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=int(eos),
        add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
        stop_token_ids=frozenset(stops),
    )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM/SmolLM2: every digit its own token, then GPT-2 splitting
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, byte_level])
    if pre in ("gpt2", "default", ""):
        return gpt2
    raise TokenizerError(f"unsupported GGUF pre-tokenizer '{pre}' (supported: smollm, llama-bpe, gpt2)")


def _scalar(value: Any) -> Any:
    """A one-element array (how ``mx.load`` returns a numeric GGUF value) as a Python scalar."""
    return value.item() if getattr(value, "size", None) == 1 else value


def _as_list(value: Any) -> list[Any]:
    """A GGUF array value (an ``mx.array`` or a list) as a list."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _sentencepiece(metadata: dict[str, Any], path: Path | str) -> Tokenizer:
    """A SentencePiece GGUF vocabulary as a ``tokenizers.Tokenizer``, by transformers' own GGUF
    conversion (its key mapping and its builder for the file's architecture).

    Raises:
        TokenizerError: an architecture not in :data:`SENTENCEPIECE_ARCHITECTURES`, or
            transformers is not installed.
    """
    arch = _scalar(metadata.get("general.architecture"))
    if arch not in SENTENCEPIECE_ARCHITECTURES:
        raise TokenizerError(
            f"{path}: a SentencePiece ('llama') tokenizer is supported for architectures "
            f"{', '.join(SENTENCEPIECE_ARCHITECTURES)}, not '{arch}'"
        )
    try:  # transformers >= 5 keeps it here; 4.x in integrations.ggml
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        try:
            from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer  # type: ignore
        except ImportError as exc:
            raise TokenizerError(
                f"{path}: rebuilding its SentencePiece tokenizer needs {GGUF_TOKENIZER_INSTALL}"
            ) from exc
    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    found = {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
    tokenizer, _ = convert_gguf_tokenizer(arch, {k: _plain(v) for k, v in found.items()})
    return tokenizer


def _plain(value: Any) -> Any:
    """A metadata value as Python: a string, a scalar, or a list (from ``mx.load``'s arrays
    or :func:`models.gguf.header.read_gguf_header`'s lists)."""
    if isinstance(value, str):
        return value
    if getattr(value, "size", 2) == 1 or not hasattr(value, "__iter__"):
        return _scalar(value)
    return _as_list(value)


def _bpe(vocab: dict[str, int], merges: list[str], pre: str) -> Tokenizer:
    """A byte-level BPE tokenizer from GGUF's vocabulary (token -> id) and merges ("a b"
    strings, rank order), with the pre-tokenizer named by ``tokenizer.ggml.pre``."""
    pairs = [(a, b) for a, b in (m.split(" ", 1) for m in merges)]
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok
