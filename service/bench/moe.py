"""``stepserve bench moe``: the decode step of a random Qwen3-MoE, stepserve's against mlx-lm's
own model in the same pipelined loop.

A tiny-width but full-depth model (by default Qwen3-30B-A3B's depth and routing: 48 layers,
128 experts, 8 per token; hidden 256, experts 128 wide) is built with mlx-lm's own
``qwen3_moe`` classes from a fixed seed, quantized as mlx-community's 4-bit checkpoints are
(``--bits 4``, group 64; the router at 8 bits) or left dense (``--bits 0``), and saved as a
model directory. stepserve loads that directory as it would any (``models.loader``, the
compute dtype and weight format of the device unless given) and times its compiled decode
step plus greedy selection (:func:`service.bench.profile.stepserve_timer`); mlx-lm's model
object, in the same dtype, runs the same pipelined loop with its own KV cache
(:func:`service.bench.profile.peer_timer`). With ``--peer-cache kv`` (the default) that cache
has one offset for the whole batch, so mlx-lm attends with no mask (on a GPU, MLX's fused
attention kernel) over the positions written so far; stepserve's rows have positions of
their own, so its step masks them ([B, 1, 1, C] booleans: MLX's CUDA backend then runs
attention unfused) over the whole capacity bucket. ``--peer-cache batch`` gives mlx-lm the
cache its batched generation uses for independent requests (``BatchKVCache``: an offset and
a mask per row), the same kind of attention as stepserve's. Only the weights are random: routing over random
experts spreads tokens over them as a trained router roughly does, so the step's cost (which
experts' rows each token gathers) is representative. Both loops keep the rows' tokens
distinct (:func:`service.bench.profile.distinct_rows`): rows fed the same token would all
take the same k experts.

Both sides are set up (compiled, prefilled, warmed) once per batch, then timed in
``--rounds`` interleaved rounds, stepserve then mlx-lm in each, so drift of the host over
the run falls on both sides alike. Each row keeps every round's figures (``rounds``), each
side's per-figure median over the rounds (``stepserve``, ``mlx_lm``), the ratio of the
median pipelined step times ``mlx_lm_over_stepserve`` (> 1: stepserve's step is faster) and
the smallest and largest per-round ratio (``ratio_min``, ``ratio_max``): their spread is the
noise the ratio carries.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from service.bench.common import device_defaults, machine_info


def moe_config(args: argparse.Namespace) -> dict:
    """The ``config.json`` of the benchmark's Qwen3-MoE (every layer sparse)."""
    return {
        "model_type": "qwen3_moe",
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "intermediate_size": args.hidden * 4,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.expert_width,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "vocab_size": args.vocab,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
    }


def build(config: dict, bits: int, directory: Path):
    """mlx-lm's random model of ``config`` (seed 0), quantized at ``bits`` (0: dense), saved
    into ``directory`` with a word-level tokenizer; returns the mlx-lm model."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_moe
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    mx.random.seed(0)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    if bits:
        quantization: dict = {"group_size": 64, "bits": bits}

        def predicate(path: str, module) -> bool | dict:
            if path.endswith("mlp.gate"):  # as mlx-lm's qwen3_moe.quant_predicate
                quantization[path] = {"group_size": 64, "bits": 8}
                return {"group_size": 64, "bits": 8}
            return hasattr(module, "to_quantized")

        nn.quantize(model, group_size=64, bits=bits, class_predicate=predicate)
        config = {**config, "quantization": quantization}
    mx.eval(model.parameters())
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    Tokenizer(WordLevel(vocab, unk_token="t1")).save(str(directory / "tokenizer.json"))
    return model


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepserve bench moe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-width", type=int, default=128, help="moe_intermediate_size")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--bits", type=int, default=4, choices=[0, 4, 8], help="expert weight bits (0: dense)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per side and batch")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    parser.add_argument("--weights", choices=["quantized", "dequantized"], default=None)
    parser.add_argument(
        "--peer-cache",
        choices=["kv", "batch"],
        default="kv",
        help="mlx-lm's KV cache: one offset for the batch (no mask) or one per row (a mask, as stepserve's)",
    )
    parser.add_argument("--out", type=Path)
    return parser


def summarize(rounds: list[dict]) -> dict:
    """The figures of interleaved ``rounds`` ([{"stepserve": {figure: value}, "mlx_lm":
    {figure: value}}], at least one): each side's median of each figure, the ratio of the
    median pipelined step times (mlx-lm's over stepserve's) and the smallest and largest
    per-round ratio; the rounds come back with their own ratio added."""
    rounds = [r | {"mlx_lm_over_stepserve": _ratio(r["mlx_lm"], r["stepserve"])} for r in rounds]
    median = {
        side: {f: statistics.median(r[side][f] for r in rounds) for f in rounds[0][side]}
        for side in ("stepserve", "mlx_lm")
    }
    ratios = [r["mlx_lm_over_stepserve"] for r in rounds]
    return {
        **median,
        "mlx_lm_over_stepserve": _ratio(median["mlx_lm"], median["stepserve"]),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds": rounds,
    }


def _ratio(mlx_lm: dict, stepserve: dict) -> float:
    return mlx_lm["pipelined_step_s"] / stepserve["pipelined_step_s"]


def _interleaved(ours, peer, batch: int, args: argparse.Namespace) -> list[dict]:
    """``args.rounds`` rounds at ``batch``, stepserve's timed loop then mlx-lm's in each; a line
    per round on stderr."""
    from service.bench.profile import peer_timer, stepserve_timer

    stepserve = stepserve_timer(ours, batch, args.capacity, args.steps, args.repeats)
    mlx_lm = peer_timer(peer, batch, args.capacity, args.steps, args.peer_cache)
    rounds = []
    for i in range(args.rounds):
        rounds.append({"stepserve": stepserve(), "mlx_lm": mlx_lm()})
        ours_s, peer_s = (rounds[-1][side]["pipelined_step_s"] for side in ("stepserve", "mlx_lm"))
        print(
            f"batch {batch} round {i + 1}/{args.rounds}: stepserve {ours_s * 1e3:.2f} ms, "
            f"mlx-lm {peer_s * 1e3:.2f} ms ({peer_s / ours_s:.2f}x)",
            file=sys.stderr,
            flush=True,
        )
    return rounds


def main(argv: list[str]) -> int:
    """``stepserve bench moe [options]``: print one JSON line per batch and write them all to
    ``--out``. Returns 0; exits 2 (argparse) when ``--rounds`` is below 1."""
    from models.loader import load_model

    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    dtype, weights = device_defaults(args.dtype, args.weights)
    config = moe_config(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        peer = build(config, args.bits, Path(tmp) / "model")
        peer.set_dtype(getattr(mx, dtype))
        ours = load_model(Path(tmp) / "model", "moe", getattr(mx, dtype), weights)
        for batch in args.batch:
            figures = summarize(_interleaved(ours, peer, batch, args))
            rows.append({"batch": batch, "capacity": args.capacity, **figures})
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "command": "stepserve bench moe " + " ".join(argv),
        **machine_info(in_process=True),
        "dtype": dtype,
        "weights": weights,
        "bits": args.bits,
        "peer_cache": args.peer_cache,
        "rounds": args.rounds,
        "config": config,
        "weights_bytes": ours.nbytes,
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0
