"""Token ids of a prompt by its pieces between added tokens, the long pieces kept by content.

A chat template renders every request of a chat (and every chat that shares a system prompt)
with the same long system turn. ``tokenizers`` encodes a text by first splitting it at its added
tokens (``<|im_start|>``, ``<|im_end|>``, ...: ``AddedVocabulary``'s extraction), then
normalizing, pre-tokenizing and running the model on each piece between them on its own; so a
piece's ids do not depend on the pieces around it, and the ids of a piece seen before can be
reused. :class:`SegmentEncoder` does that for pieces of at least :data:`MIN_CACHED_CHARS`
characters, in an LRU bounded by :data:`CACHE_CHARS` characters.

That holds only where a piece's encoding depends on nothing but its text. It is checked on the
tokenizer's own serialization (:func:`segments_independent`) and the encoder is not built
otherwise:
- every added token matches its text exactly (no ``lstrip``/``rstrip``/``single_word``, not
  ``normalized``), and special tokens are split out (``encode_special_tokens`` off);
- the normalizer, if any, and every pre-tokenizer are of kinds that look at a piece's text alone.
  ``Metaspace`` is not: with ``prepend_scheme: first`` it prepends ``▁`` only to the piece at
  the start of the whole text (SentencePiece conversions, e.g. Gemma's).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from tokenizers import Tokenizer

#: Pieces shorter than this are encoded each time (a short user turn costs microseconds).
MIN_CACHED_CHARS = 512
#: The LRU's bound, in characters of the pieces it keeps (each kept id is a Python int).
CACHE_CHARS = 2_000_000
#: Normalizers and pre-tokenizers that transform a piece by its text alone (``tokenizers``'
#: serialized ``type`` names).
_PIECEWISE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents", "Replace"})
_PIECEWISE_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Split", "Digits", "Whitespace", "WhitespaceSplit", "Punctuation", "BertPreTokenizer"}
)


def _kinds_allowed(node: dict[str, Any] | None, allowed: frozenset[str], children: str) -> bool:
    if node is None:
        return True
    if node.get("type") == "Sequence":
        return all(_kinds_allowed(n, allowed, children) for n in node.get(children, []))
    return node.get("type") in allowed


def segments_independent(tokenizer: Tokenizer) -> bool:
    """Whether encoding ``tokenizer``'s text piece by piece (split at its added tokens) gives
    the ids of encoding it whole, by the conditions in this module's docstring. False for any
    component it does not know."""
    spec = json.loads(tokenizer.to_str())
    exact = all(
        not (t.get("lstrip") or t.get("rstrip") or t.get("single_word") or t.get("normalized"))
        for t in spec.get("added_tokens", [])
    )
    return (
        exact
        and not tokenizer.encode_special_tokens
        and _kinds_allowed(spec.get("normalizer"), _PIECEWISE_NORMALIZERS, "normalizers")
        and _kinds_allowed(spec.get("pre_tokenizer"), _PIECEWISE_PRE_TOKENIZERS, "pretokenizers")
    )


class SegmentEncoder:
    """Encodes text as ``tokenizer.encode(text, add_special_tokens=False).ids`` does, reusing
    the ids of long pieces between added tokens that it has encoded before.

    Thread-safe (the API tokenizes long prompts on a worker thread). Build it only where
    :func:`segments_independent` holds; :meth:`build` returns None otherwise.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ids = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        # longest first: at one position the longest added token wins, as in tokenizers' own split
        added = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        self._kept: OrderedDict[str, list[int]] = OrderedDict()
        self._kept_chars = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0  # long pieces found / encoded and kept

    @classmethod
    def build(cls, tokenizer: Tokenizer) -> SegmentEncoder | None:
        """An encoder for ``tokenizer``, or None where pieces are not independent."""
        return cls(tokenizer) if segments_independent(tokenizer) else None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added), equal to encoding it whole."""
        if self._split is None or len(text) < MIN_CACHED_CHARS:
            return self._whole(text)
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # re.split puts the captured added tokens at odd indices
                ids.append(self._ids[piece])
            elif len(piece) >= MIN_CACHED_CHARS:
                ids += self._piece(piece)
            elif piece:
                ids += self._whole(piece)
        return ids

    def _whole(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _piece(self, piece: str) -> list[int]:
        with self._lock:
            kept = self._kept.get(piece)
            if kept is not None:
                self._kept.move_to_end(piece)
                self.hits += 1
                return kept
        ids = self._whole(piece)
        if len(piece) <= CACHE_CHARS:
            with self._lock:
                self.misses += 1
                if piece not in self._kept:
                    self._kept[piece] = ids
                    self._kept_chars += len(piece)
                while self._kept_chars > CACHE_CHARS:
                    old, _ = self._kept.popitem(last=False)
                    self._kept_chars -= len(old)
        return ids
