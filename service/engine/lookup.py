"""Prompt lookup: speculative proposals copied from the request's own text, no extra model.

The n-gram that ends the row's tokens (prompt and output so far) is looked up among its earlier
n-grams; the tokens that followed its latest earlier occurrence are proposed (Saxena 2023,
"Prompt Lookup Decoding"; vLLM's n-gram proposer, llama.cpp's lookup decoding). Retrieval,
code editing, summarisation and quoting copy long spans of the prompt, so the proposals are
often right; open-ended text rarely matches, and then nothing is proposed.

Plain Python, no MLX: an incremental index per row (n-gram -> the latest position it ended at)
makes each step cost the new tokens only, not the whole text.
"""

from __future__ import annotations

NGRAM_MAX = 4  # the longest suffix looked up first (a longer match is a better guess)
NGRAM_MIN = 2  # the shortest suffix looked up (single tokens match too often to be worth it)


class NgramIndex:
    """The n-grams (``NGRAM_MIN``..``NGRAM_MAX`` tokens) of one growing token sequence.

    ``latest[ngram]`` is the index of the last token of the latest occurrence of ``ngram`` that
    has a successor, so a lookup of the sequence's own suffix never finds itself.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` and index the n-grams that now have a successor."""
        start = len(self.tokens)
        self.tokens += tokens
        for end in range(max(start - 1, 0), len(self.tokens) - 1):  # n-grams ending at ``end``
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end + 1 >= n:
                    self.latest[tuple(self.tokens[end + 1 - n : end + 1])] = end

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
        (``NGRAM_MAX`` down to ``NGRAM_MIN`` tokens) seen before; [] when none was."""
        t = self.tokens
        for n in range(min(NGRAM_MAX, len(t) - 1), NGRAM_MIN - 1, -1):
            end = self.latest.get(tuple(t[len(t) - n :]))
            if end is not None:
                return t[end + 1 : end + 1 + k]
        return []


class PromptLookup:
    """Prompt-lookup proposals for the rows of a batch, one :class:`NgramIndex` per request."""

    method = "lookup"

    def __init__(self) -> None:
        self._index: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, prompt: list[int], output: list[int], k: int) -> list[int]:
        """Up to ``k`` proposed tokens to follow the request's ``prompt`` and ``output`` so far
        (they only grow between calls for one request; only the new tokens are read)."""
        index = self._index.setdefault(request_id, NgramIndex())
        seen = len(index.tokens)
        if seen < len(prompt):
            index.extend(prompt[seen:] + output)
        else:
            index.extend(output[seen - len(prompt) :])
        return index.propose(k) if k > 0 else []

    def forget(self, keep: set[str]) -> None:
        """Drop the indexes of requests not in ``keep`` (they finished)."""
        for rid in [r for r in self._index if r not in keep]:
            del self._index[rid]
