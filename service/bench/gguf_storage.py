"""``stepserve bench gguf-storage``: how to keep a GGUF's K-quant tensors, measured.

MLX cannot read K-quants (Q4_K, Q6_K) or Q5_0; the ``gguf`` package dequantizes them to float32
(:mod:`models.gguf.quants`). They can then be kept dense (the exact values the GGUF holds) or
re-quantized with ``mx.quantize`` to MLX's affine format (group 32, one scale and bias per
group), which cannot hold the K-quants' sub-block scales, so it rounds the values again.

For each storage this runs greedy decoding of a prompt set (float32 compute, the dense run's
tokens fed to every run, so each step compares the same context) and reports the largest
|logit difference| to the dense run, how many steps pick the same top token, how many prompts
keep the dense run's whole greedy continuation, and the weights' bytes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from service.bench.common import machine_info

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The theory of relativity states that",
    "import numpy as np\n",
    "My favourite recipe for pancakes:",
]
#: Each storage: a tensor's GGUF type name -> MLX affine bits (None: dense).
SAME_BITS = {"Q4_K": 4, "Q5_0": 5, "Q6_K": 6, "Q8_0": 8}
STORAGES: dict[str, Callable[[str], int | None]] = {
    "dense": lambda t: None,
    "affine-same-bits-g32": lambda t: SAME_BITS.get(t),
    "affine-8bit-g32": lambda t: 8 if t in SAME_BITS else None,
    "affine-4bit-g32": lambda t: 4 if t in SAME_BITS else None,
}


def stored(tensors: dict[str, mx.array], types: dict[str, str], bits_of: Callable[[str], int | None]) -> dict:
    """``tensors`` with each 2-D quantized-type tensor re-quantized at ``bits_of(type)`` (group 32)."""
    out = {}
    for name, value in tensors.items():
        bits = bits_of(types[name]) if value.ndim == 2 else None
        if bits is None:
            out[name] = value
            continue
        w, scales, biases = mx.quantize(value, group_size=32, bits=bits)
        stem = name.removesuffix(".weight")
        out |= {name: w, f"{stem}.scales": scales, f"{stem}.biases": biases}
    return out


def greedy(model, tokens_in: list[list[int]] | None, steps: int) -> tuple[list[list[int]], list[list[mx.array]]]:
    """Per prompt, greedy tokens and the logits of each step; with ``tokens_in``, those tokens
    are fed instead of the run's own (teacher forcing)."""
    from models.architectures import architecture
    from models.kv_cache import KVCache

    a, arch = model.args, architecture(model.args.model_type)
    tokens, logits_out = [], []
    for i, prompt in enumerate(PROMPTS):
        ids = model.tokenizer.encode(prompt)
        kv = KVCache.allocate(a.num_hidden_layers, 1, a.num_key_value_heads, len(ids), a.dim_per_head, mx.float32)
        logits, kv = arch.prefill(model.params, mx.array([ids]), mx.array([len(ids)]), kv, args=a)
        decode_kv = KVCache.allocate(a.num_hidden_layers, 1, a.num_key_value_heads, 256, a.dim_per_head, mx.float32)
        decode_kv.insert_row(0, kv, 0, len(ids))
        own, history = [], []
        for step in range(steps):
            history.append(logits[0])
            own.append(int(mx.argmax(logits[0])))
            feed = tokens_in[i][step] if tokens_in else own[-1]
            logits, decode_kv = arch.decode(
                model.params, mx.array([feed]), mx.array([len(ids) + step]), decode_kv, args=a
            )
        tokens.append(own)
        logits_out.append(history)
    return tokens, logits_out


def measure(path: Path, steps: int) -> list[dict]:
    """One row per :data:`STORAGES` entry for the GGUF at ``path``."""
    from dataclasses import replace

    from models.gguf.header import read_gguf_header
    from models.gguf.quants import type_names
    from models.gguf.reader import args_from_metadata, params_from_tensors, read_gguf
    from models.gguf.vocab import tokenizer_from_gguf
    from models.loader import LoadedModel

    tensors, metadata = read_gguf(path)
    types = type_names(path, read_gguf_header(path))
    args = args_from_metadata(metadata, tensors, path)
    tokenizer = tokenizer_from_gguf(metadata, path)
    rows, reference = [], None
    for name, bits_of in STORAGES.items():
        params = params_from_tensors(stored(tensors, types, bits_of), args, path)
        model = LoadedModel(
            name, path, replace(args, quant_group_size=32), params, tokenizer, mx.float32, "quantized", 0
        )
        if reference is None:
            reference = greedy(model, None, steps)
            rows.append({"storage": name, "weights_bytes": model.nbytes})
            continue
        _, forced = greedy(model, reference[0], steps)
        own, _ = greedy(model, None, steps)
        pairs = [(a, b) for x, y in zip(forced, reference[1], strict=True) for a, b in zip(x, y, strict=True)]
        row = {
            "storage": name,
            "weights_bytes": model.nbytes,
            "max_abs_logit_diff": mx.max(mx.stack([mx.abs(a - b).max() for a, b in pairs])).item(),
            "top1_agree": f"{sum(int(mx.argmax(a)) == int(mx.argmax(b)) for a, b in pairs)}/{len(pairs)}",
            "greedy_identical_prompts": f"{sum(a == b for a, b in zip(own, reference[0], strict=True))}/{len(own)}",
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str]) -> int:
    """``stepserve bench gguf-storage --gguf PATH [--steps N] [--out FILE]``. Returns 0."""
    parser = argparse.ArgumentParser(prog="stepserve bench gguf-storage", description=__doc__)
    parser.add_argument("--gguf", type=Path, required=True, help="a GGUF with tensor types MLX cannot read")
    parser.add_argument("--steps", type=int, default=16, help="greedy steps per prompt")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = {
        "command": "stepserve bench gguf-storage " + " ".join(argv),
        **machine_info(in_process=True),
        "prompts": PROMPTS,
        "rows": measure(args.gguf, args.steps),
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0
