"""Structured outputs: per-request token masks from a grammar engine (llguidance).

A request with ``response_format`` (a JSON schema, or any JSON object) or a forced tool call
(a Lark grammar, :func:`service.api.tools.tool_grammar`) carries a :class:`Grammar`; its
sequence holds a :class:`Matcher`. Before each of the row's steps the runner asks the matcher
for the allowed tokens as a bitmask (int32 words, bit ``j % 32`` of word ``j // 32`` set when
token ``j`` is allowed, llguidance's layout), which enters the compiled sampler as an input of
static shape [B, ceil(V / 32)] (:func:`models.sampling.process`); after the step the sampled
token advances the matcher. Once the grammar is complete only the end-of-sequence tokens are
allowed, so the row stops.

llguidance (https://github.com/guidance-ai/llguidance) compiles JSON schemas and Lark grammars
lazily against the tokenizer's token trie; why it and not xgrammar or outlines-core:
docs/STRUCTURED_OUTPUTS.md.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from models.tokenizer import ChatTokenizer

# JSON output as OpenAI's and vLLM's JSON modes write it: no whitespace freedom (a small model
# would otherwise spend tokens on newlines), the usual separators.
_JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per model (clients tend to send the same few schemas)


class GrammarError(ValueError):
    """A grammar or schema the engine cannot compile; the message names the problem."""


class TokenGrammar:
    """Compiles grammars for one model's tokenizer (build once per model; thread-safe), and
    keeps the last ``GRAMMAR_CACHE_SIZE`` compiled (by schema or grammar text), so a schema a
    client sends again is not compiled again.

    Args:
        tokenizer: the model's tokenizer; its stop tokens are the grammar's end of sequence.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary: the
            extra ids are never allowed).

    Raises:
        GrammarError: llguidance cannot read the tokenizer (its ``tokenizer.json`` has no
            decoder, or one llguidance does not know, such as WordPiece).
    """

    def __init__(self, tokenizer: ChatTokenizer, vocab_size: int):
        stops = sorted(tokenizer.stop_token_ids | {tokenizer.eos_token_id})
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words per mask row
        # llguidance reads the tokenizer's own JSON (no `transformers`); with n_vocab it sizes
        # its masks to the logits width and never allows the ids past the tokenizer's vocabulary.
        try:
            self._tokenizer = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab_size, eos_token=stops)
        except ValueError as exc:
            raise GrammarError(
                f"the grammar engine cannot read this model's tokenizer ({exc}): structured outputs and "
                "forced tool calls are unavailable for it"
            ) from exc
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple, Grammar] = OrderedDict()  # LRU of GRAMMAR_CACHE_SIZE

    def json_object(self) -> Grammar:
        """Any JSON object."""
        return self.json_schema({"type": "object"})

    def json_schema(self, schema: dict[str, Any], strict: bool = True) -> Grammar:
        """JSON valid against ``schema`` (a JSON Schema object).

        With ``strict`` False, keywords the engine does not implement are skipped (llguidance's
        ``lenient`` mode); with True they are an error.

        Raises:
            GrammarError: ``schema`` is not an object or the engine cannot compile it.
        """
        if not isinstance(schema, dict):
            raise GrammarError("schema: must be a JSON object")
        source = json.dumps(schema)  # key order kept: it is the order of the generated JSON's keys
        if (cached := self._cached(("schema", source, strict))) is not None:
            return cached
        options = {**_JSON_OPTIONS, **({} if strict else {"lenient": True})}
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=options)  # type: ignore[arg-type]  # a TypedDict
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(f"schema: {exc}") from exc
        return self._keep(("schema", source, strict), self._compile(text, "schema"))

    def lark(self, text: str) -> Grammar:
        """A Lark grammar in llguidance's dialect (``%json {...}`` embeds a JSON schema).

        Raises:
            GrammarError: the grammar does not compile.
        """
        if (cached := self._cached(("lark", text))) is not None:
            return cached
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(f"grammar: {exc}") from exc
        return self._keep(("lark", text), self._compile(grammar, "grammar"))

    def _cached(self, key: tuple) -> Grammar | None:
        """The grammar compiled for ``key`` before, marked most recently used; None if none."""
        with self._lock:
            if (grammar := self._compiled.get(key)) is not None:
                self._compiled.move_to_end(key)
            return grammar

    def _keep(self, key: tuple, grammar: Grammar) -> Grammar:
        with self._lock:
            self._compiled[key] = grammar
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return grammar

    def _compile(self, grammar: str, what: str) -> Grammar:
        with self._lock:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise GrammarError(f"{what}: {_problem('; '.join(messages) or 'does not compile')}")
        start = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if start.is_error():
            raise GrammarError(f"{what}: {_problem(start.get_error())}")
        return Grammar(start, self.words)


def _problem(message: str) -> str:
    """llguidance's message, with its list of JSON Schema keywords it does not implement
    (``Unimplemented keys: ["not"]``) said the way the API reports it."""
    found = re.search(r"Unimplemented keys: \[(.*?)\]", message)
    if found is None:
        return message
    keys = [f"'{k.strip().strip(chr(34))}'" for k in found.group(1).split(",")]
    noun = "keyword" if len(keys) == 1 else "keywords"
    return f"unsupported {noun} {', '.join(keys)} (with strict false such keywords are skipped)"


class Grammar:
    """A compiled grammar: a matcher at its start, never advanced; :meth:`matcher` gives each
    request its own copy (compiled grammars are shared across requests: see
    :class:`TokenGrammar`'s cache)."""

    def __init__(self, start: llguidance.LLMatcher, words: int):
        self._start, self._words = start, words

    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start (a copy: microseconds, not a compile)."""
        return Matcher(self._start.deep_copy(), self._words)


_EXECUTOR: llguidance.LLExecutor | None = None


def fill_masks(rows: list[tuple[Matcher, int]], out: np.ndarray) -> None:
    """Fill the allowed-token bitmask of several rows at once (``out`` int32 [B, W],
    C-contiguous; ``rows`` pairs a matcher with its row of ``out``).

    One call into llguidance's thread pool, which computes the rows in parallel with the GIL
    released (the engine's event loop runs meanwhile). A matcher in an error state gets an
    all-ones row, as :meth:`Matcher.fill_mask` gives it.
    """
    global _EXECUTOR
    healthy = [(m._m, row) for m, row in rows if not m._m.is_error()]
    for m, row in rows:
        if m._m.is_error():
            out[row] = -1
    if not healthy:
        return
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    llnp.fill_next_token_bitmask_par(_EXECUTOR, healthy, out)


class Matcher:
    """One request's position in its grammar (used by the engine thread only)."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self._m, self._words = matcher, words

    def fill_mask(self, out: np.ndarray, row: int) -> None:
        """Write the allowed tokens into ``out[row]`` (int32 [B, W] bitmask, C-contiguous).

        After an error (a token outside the grammar was forced on it) every token is allowed
        except that the row can still stop: the output is then unconstrained, and logged."""
        if self._m.is_error():
            out[row] = -1
            return
        llnp.fill_next_token_bitmask(self._m, out, row)

    def advance(self, token: int) -> bool:
        """Accept a sampled token; False (no exception) when the grammar did not allow it."""
        return bool(self._m.consume_token(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may extend it: only a stop token may follow (or
        one has been taken). False while the grammar accepts but could go on (``"a"+`` after
        ``a``), and False in the error state."""
        return self._m.is_stopped() and not self._m.is_error()
