"""The long texts the load generator sends (:mod:`service.bench.load`): a chat system prompt
and copy-heavy passages of about a given number of tokens, generated here (the same text for
the same arguments), and the server-independent token count that sizes them."""

from __future__ import annotations

import re

from service.bench.common import ESSAY_TOPICS, WORDS


def estimate_tokens(text: str) -> int:
    """Tokens in ``text`` by a server-independent count: one per word and one per punctuation
    mark (``\\w+|[^\\w\\s]``). For the plain English of :func:`system_prompt` it matched
    SmolLM2's tokenizer within 1% (1,512 counted, 1,513 encoded)."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def system_prompt(tokens: int) -> str:
    """A chat system prompt of about ``tokens`` tokens (:func:`estimate_tokens`), made here: an
    opening and then rule sentences built from :data:`WORDS`, the same text for the same
    ``tokens``."""
    parts = ["You are the archivist of a small harbour town. Answer each question in plain words."]
    i = 0
    while estimate_tokens(" ".join(parts)) < tokens:
        a, b, c = WORDS[i % len(WORDS)], WORDS[(i * 3 + 1) % len(WORDS)], WORDS[(i * 7 + 2) % len(WORDS)]
        parts.append(f"When you speak of the {a}, mention the {b} and the {c}; keep the answer short, kind and exact.")
        i += 1
    return " ".join(parts)


def passage(index: int, tokens: int) -> str:
    """A plain-English passage of about ``tokens`` tokens (:func:`estimate_tokens`), sentences
    built from :data:`WORDS` and :data:`ESSAY_TOPICS`; a different one for each ``index``."""
    parts: list[str] = []
    i = index * 7
    while estimate_tokens(" ".join(parts)) < tokens:
        a, b, c = WORDS[i % len(WORDS)], WORDS[(i * 3 + 1) % len(WORDS)], WORDS[(i * 5 + 2) % len(WORDS)]
        topic = ESSAY_TOPICS[(i + index) % len(ESSAY_TOPICS)]
        parts.append(f"By the {a} near the {b}, a keeper of the {c} wrote a long letter about {topic}.")
        i += 1
    return " ".join(parts)


def copy_task(index: int, tokens: int) -> str:
    """The user turn of copy-heavy request ``index``: even ones edit a passage (one word replaced
    throughout), odd ones repeat it word for word."""
    text = passage(index, tokens)
    if index % 2:
        return f"Repeat the following text exactly, word for word, and nothing else:\n\n{text}"
    old = WORDS[index % len(WORDS)]
    return f"Rewrite the following text with every '{old}' replaced by 'tower', changing nothing else:\n\n{text}"
