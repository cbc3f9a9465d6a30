"""``python -m service.bench.grammar``: host cost of structured outputs per grammar engine.

For the default model's tokenizer and a nested JSON schema (an object in an object, arrays of
strings and of objects, enums, integer bounds), each engine that imports here — llguidance
(stepserve's), xgrammar, outlines-core — is timed on: compiling the schema (cold, then from its
cache where it has one), and, over a fixed valid 202-token document (and the end-of-sequence
token), computing the next-token bitmask and advancing by one token. The first token's time is
also reported apart: an engine that compiles lazily (llguidance) pays part of its compile there.
JSON to stdout (and ``--out``). Measurements: docs/STRUCTURED_OUTPUTS.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np

from models.default import default_model_path
from models.gguf.reader import read_gguf
from models.gguf.vocab import tokenizer_from_gguf
from models.tokenizer import ChatTokenizer

VOCAB = 49152  # SmolLM2-135M's logits width
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "projects": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "status": {"enum": ["planned", "active", "done"]},
                    "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "required": ["title", "status", "stars"],
                "additionalProperties": False,
            },
            "minItems": 1,
        },
        "bio": {"type": "string"},
    },
    "required": ["name", "age", "role", "address", "tags", "projects", "bio"],
}
DOCUMENT = {  # 202 tokens with the default tokenizer (json.dumps separators)
    "name": "Ann Lee of the northern coast",
    "age": 34,
    "role": "admin",
    "address": {"city": "Paris", "zip": 75001},
    "tags": ["reader", "cyclist", "cook", "pianist", "gardener", "runner"],
    "projects": [
        {"title": "A field guide to the birds of the northern coast", "status": "done", "stars": 4},
        {"title": "Bread at home, week by week", "status": "active", "stars": 5},
        {"title": "The lighthouse keepers' letters, transcribed", "status": "planned", "stars": 3},
        {"title": "Tide tables for small harbours", "status": "active", "stars": 2},
    ],
    "bio": "Reads on the train, rides on weekends, bakes on Sundays and writes about all three in a small newsletter.",
}


def _llguidance(tok: ChatTokenizer, ids: list[int]) -> dict:
    import llguidance
    import llguidance.numpy as llnp

    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=VOCAB, eos_token=tok.eos_token_id)
    tokenizer_s = time.perf_counter() - start
    options = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    compiles = []
    for _ in range(3):
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=options)  # type: ignore[arg-type]
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        compiles.append(time.perf_counter() - start)
    mask = llnp.allocate_token_bitmask(1, VOCAB)
    per_token = []
    for token in ids:
        start = time.perf_counter()
        llnp.fill_next_token_bitmask(matcher, mask, 0)
        ok = matcher.consume_token(token)
        per_token.append(time.perf_counter() - start)
        assert ok, f"llguidance refused token {token}"
    return {
        "version": _version("llguidance"),
        "tokenizer_s": tokenizer_s,
        "compile_s": compiles,
        "per_token_s": per_token,
    }


def _xgrammar(tok: ChatTokenizer, ids: list[int]) -> dict:
    import xgrammar as xgr  # type: ignore[import-not-found]

    start = time.perf_counter()
    info = xgr.TokenizerInfo(
        _pieces(tok), vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=VOCAB, stop_token_ids=[tok.eos_token_id]
    )
    compiler = xgr.GrammarCompiler(info)
    tokenizer_s = time.perf_counter() - start
    compiles = []
    for _ in range(3):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        compiles.append(time.perf_counter() - start)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    per_token = []
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        ok = matcher.accept_token(token)
        per_token.append(time.perf_counter() - start)
        assert ok, f"xgrammar refused token {token}"
    return {
        "version": _version("xgrammar"),
        "tokenizer_s": tokenizer_s,
        "compile_s": compiles,
        "per_token_s": per_token,
    }


def _outlines_core(tok: ChatTokenizer, ids: list[int]) -> dict:
    from outlines_core import Guide, Index, Vocabulary  # type: ignore[import-not-found]
    from outlines_core.json_schema import build_regex_from_schema  # type: ignore[import-not-found]

    start = time.perf_counter()
    eos = tok.eos_token_id
    decode = {c: b for b, c in _byte_level_table().items()}
    tokens: dict[bytes, list[int]] = {}
    for piece, i in tok.tokenizer.get_vocab(with_added_tokens=False).items():
        if i != eos and all(c in decode for c in piece):
            tokens.setdefault(bytes(decode[c] for c in piece), []).append(i)
    vocab = Vocabulary(eos, tokens)  # token bytes -> ids (its own vocabulary type needs the Hub)
    tokenizer_s = time.perf_counter() - start
    compiles = []
    for _ in range(3):
        start = time.perf_counter()
        regex = build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern="[ ]?")
        index = Index(regex, vocab)
        compiles.append(time.perf_counter() - start)
    guide = Guide(index)
    per_token = []
    for token in ids[:-1]:  # its guide ends in a final state rather than taking the EOS token
        start = time.perf_counter()
        guide.get_tokens()
        guide.advance(token)
        per_token.append(time.perf_counter() - start)
    return {
        "version": _version("outlines-core"),
        "tokenizer_s": tokenizer_s,
        "compile_s": compiles,
        "per_token_s": per_token,
    }


def _version(package: str) -> str:
    return importlib.metadata.version(package)


def _byte_level_table() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE vocabularies (Radford et al.
    2019, ``bytes_to_unicode`` in its encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pieces(tok: ChatTokenizer) -> list[str]:
    """The vocabulary's pieces in id order, as the tokenizer stores them."""
    vocab = tok.tokenizer.get_vocab()
    pieces = [""] * (max(vocab.values()) + 1)
    for piece, i in vocab.items():
        pieces[i] = piece
    return pieces


ENGINES = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines_core}


def _summary(result: dict) -> dict:
    per = result.pop("per_token_s")
    return {
        **result,
        "tokens": len(per),
        "first_token_us": 1e6 * per[0],
        "per_token_us_mean": 1e6 * float(np.mean(per)),
        "per_token_us_p50": 1e6 * median(per),
        "per_token_us_p99": 1e6 * float(np.percentile(per, 99)),
        "compile_s_first": result["compile_s"][0],
        "compile_s_again": min(result["compile_s"][1:]),
    }


def main(argv: list[str] | None = None) -> int:
    """Time every importable engine; print the JSON (and write ``--out``). Returns 0."""
    parser = argparse.ArgumentParser(prog="python -m service.bench.grammar", description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    _, metadata = read_gguf(default_model_path())
    tok = tokenizer_from_gguf(metadata)
    ids = tok.encode(json.dumps(DOCUMENT)) + [tok.eos_token_id]
    results: dict = {}
    for name, run in ENGINES.items():
        try:
            results[name] = _summary(run(tok, ids))
        except ImportError as exc:
            results[name] = {"error": f"not installed: {exc}"}
        except Exception as exc:  # an engine that fails here is reported, not fatal
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    out = {
        "schema": SCHEMA,
        "document_tokens": len(ids),
        "vocab": VOCAB,
        "engines": results,
        "command": "python -m service.bench.grammar " + " ".join(argv or sys.argv[1:]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": platform.platform(),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
