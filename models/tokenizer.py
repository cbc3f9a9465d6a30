"""Tokenizer and chat template rebuilt from GGUF metadata, with `tokenizers` and `jinja2`.

GGUF stores a byte-level BPE vocabulary (``tokenizer.ggml.model: gpt2``) as
``tokenizer.ggml.tokens`` (id order), ``tokenizer.ggml.merges`` ("a b" strings, rank order)
and ``tokenizer.ggml.token_type`` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte: llama.cpp's ``llama_token_type``). ``tokenizer.ggml.pre`` names the pre-tokenizer;
the regexes below are the ones llama.cpp (llama-vocab.cpp) and the models' own
``tokenizer.json`` use.

A SentencePiece vocabulary (``tokenizer.ggml.model: llama``, Gemma's: tokens, scores and
types, no merges) is rebuilt by transformers' GGUF tokenizer conversion
(``convert_gguf_tokenizer``, which derives the merges and Gemma's normalizer), not here:
an optional dependency, ``pip install 'stepserve[gguf]'``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

from models.segments import SegmentEncoder

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


class TokenizerError(ValueError):
    """The GGUF tokenizer metadata is missing or of an unsupported kind."""


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
    or :func:`models.gguf_header.read_gguf_header`'s lists)."""
    if isinstance(value, str):
        return value
    if getattr(value, "size", 2) == 1 or not hasattr(value, "__iter__"):
        return _scalar(value)
    return _as_list(value)


def _bpe(vocab: dict[str, int], merges: list[str], pre: str) -> Tokenizer:
    """A byte-level BPE tokenizer from GGUF's vocabulary (token -> id) and merges ("a b"
    strings, rank order), with the pre-tokenizer named by ``tokenizer.ggml.pre``."""
    pairs = [(a, b) for a, b in (m.split(" ", 1) for m in merges)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


@dataclass
class ChatTokenizer:
    """A `tokenizers.Tokenizer` plus the model's chat template and stop tokens.

    Attributes:
        tokenizer: the byte-level BPE tokenizer.
        chat_template: Jinja2 source of the chat template, or None.
        bos_token_id / eos_token_id: ids from the GGUF metadata.
        add_bos: whether a raw prompt gets BOS prepended (``tokenizer.ggml.add_bos_token``).
        stop_token_ids: ids that end a generation (EOS, EOT, ``<|endoftext|>``).
    """

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int
    add_bos: bool
    stop_token_ids: frozenset[int]
    _template: Any = field(default=None, repr=False)
    #: Reuses the ids of long pieces between added tokens (a chat's system turn); None where
    #: the tokenizer's pieces are not independent (``models.segments``).
    segments: SegmentEncoder | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.segments = SegmentEncoder.build(self.tokenizer)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any], path: Path | str = "<gguf>") -> ChatTokenizer:
        """Rebuild the tokenizer from GGUF metadata (values as returned by ``mx.load``).

        Raises:
            TokenizerError: no tokenizer in the file, no EOS token id, or a tokenizer model
                other than byte-level BPE (``tokenizer.ggml.model == "gpt2"``).
        """

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
        return cls(
            tokenizer=tok,
            chat_template=get("tokenizer.chat_template"),
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=int(eos),
            add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
            stop_token_ids=frozenset(stops),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of a raw prompt; special-token text (``<|im_start|>``) maps to its id.
        With ``add_bos``, BOS is prepended unless the text already starts with it (a chat
        template that writes ``{{ bos_token }}``, as Gemma's does: transformers'
        ``apply_chat_template`` does not add a second one either). Long pieces between added
        tokens seen before are not encoded again (:attr:`segments`): the ids are the same."""
        if self.segments is not None:
            ids = self.segments.encode(text)
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
        """Render ``messages`` (and ``tools``) with the model's chat template and a generation
        prompt, as Hugging Face transformers does.

        Messages are dicts: ``role``; ``content`` a string, None (an assistant turn with
        ``tool_calls``) or a list of ``{"type": "text", "text"}`` parts (joined); ``tool_calls``
        in OpenAI's shape, whose ``function.arguments`` JSON string is passed to the template
        parsed to a dict (as transformers' docs ask); ``tool_call_id`` for ``tool`` turns.
        ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) become the template's
        ``tools`` variable; a template that does not use it ignores them (see
        ``service.api.tools.render_messages`` for the fallback).

        Rendered in Jinja2's immutable sandbox with transformers' extras: ``tojson`` without
        HTML escaping, ``raise_exception``, ``strftime_now`` and the ``loopcontrols`` extension.

        Raises:
            TokenizerError: the model has no chat template, or rendering it failed
                (e.g. the template's own ``raise_exception`` on a bad role order).
        """
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; send 'prompt' instead of 'messages'")
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        tokens = self.tokenizer
        try:
            return self._template.render(
                messages=[_template_message(m) for m in messages],
                tools=tools or None,
                add_generation_prompt=True,
                bos_token=tokens.id_to_token(self.bos_token_id) if self.bos_token_id is not None else "",
                eos_token=tokens.id_to_token(self.eos_token_id),
            )
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. '\n' + None content
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def detokenizer(self) -> Detokenizer:
        """A fresh incremental detokenizer for one sequence."""
        return Detokenizer(self.tokenizer)

    @cached_property
    def longest_token_bytes(self) -> int:
        """Bytes of the longest token in the vocabulary, added tokens included.

        Byte-level BPE vocabulary entries spell one character per byte (GPT-2's
        byte-to-unicode table), so an entry's length is its byte count; any other vocabulary
        (SentencePiece: ``▁`` for a space, ``<0x41>`` for a byte) and added tokens are plain
        text, measured in UTF-8 (never fewer bytes than the text they decode to).
        """
        added = [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]
        vocab = self.tokenizer.get_vocab(with_added_tokens=False)
        if isinstance(self.tokenizer.decoder, decoders.ByteLevel):
            base = max(len(t) for t in vocab)
        else:
            base = max(len(t.encode()) for t in vocab)
        return max([base, *(len(t.encode()) for t in added)])


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """Jinja2 as transformers' ``_compile_jinja_template`` sets it up for chat templates."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def raise_exception(message):
        raise TokenizerError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as templates take it: list content joined, tool call arguments as dicts,
    no ``tool_calls`` key unless there are calls (Llama 3.1 tests ``'tool_calls' in message``)."""
    out = dict(message)
    if isinstance(content := out.get("content"), list):
        out["content"] = "".join(p.get("text") or "" for p in content)
    if calls := out.pop("tool_calls", None):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": tool_arguments(c["function"].get("arguments"))}}
            for c in calls
        ]
    return out


def tool_arguments(value: Any) -> Any:
    """A tool call's ``function.arguments``: a JSON object string parsed to a dict, anything
    else (a dict, invalid JSON, JSON that is not an object) as it is."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


class Detokenizer:
    """Incremental detokenization: text appears as soon as it is whole UTF-8.

    Wraps ``tokenizers.decoders.DecodeStream``, which holds back bytes of a character split
    across tokens (it returns None until the character completes).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        """Feed one token id; return the newly completed text ('' while a character is partial)."""
        return self._stream.step(self._tokenizer, token_id) or ""
