"""``stepserve bench random-model``: a model directory of mlx-lm's own class at a named shape, with
random weights, for speed at real size where the real checkpoint is not at hand.

Shapes (``--shape``):

* ``llama-8b``: Llama 3.1 8B's (hidden 4,096, 32 layers, 32 query and 8 key-value heads of 128,
  an FFN of 14,336, RoPE theta 500,000; the checkpoint's ``config.json``);
* ``llama-1b``: Llama 3.2 1B's widths at 16 layers (hidden 2,048, 32 heads of 64, 8 KV heads, FFN
  8,192);
* ``qwen3-0.6b``: Qwen3-0.6B's (hidden 1,024, 28 layers, 16 query and 8 key-value heads of 128,
  per-head query/key norms, an FFN of 3,072, tied embeddings);
* ``qwen2.5-0.5b``: Qwen2.5-0.5B's (hidden 896, 24 layers, 14 query and 2 key-value heads of 64,
  Q/K/V biases, an FFN of 4,864, tied embeddings);
* ``qwen3-moe``: Qwen3-30B-A3B's depth (48 layers, every one a mixture of experts, top-k
  renormalized) at small widths (hidden 512, 8 heads and 4 KV heads of 64, 16 experts top-4 of
  256);
* ``qwen3-next``: Qwen3-Next-80B-A3B's depth and layer pattern (48 layers, every fourth full
  attention, the rest gated delta nets; 512 routed experts top-10 and a shared expert there) at
  small widths (hidden 512, 16 experts top-4 of 128);
* ``gpt-oss``: gpt-oss-20b's depth and pattern (24 layers alternating 128-token sliding and full
  attention, top-4 experts) at small widths (hidden 512, 16 experts of 256).

The vocabulary, tokenizer and chat template come from ``--tokenizer-from`` (a model directory,
e.g. the default model converted by ``stepserve convert``), so the served text is the default
model's. Weights are quantized with ``nn.quantize`` at ``--bits`` (group ``--group-size``; 0 bits:
kept in ``--dtype``) and saved as mlx-lm saves a model (``mlx_lm.utils.save_model`` and
``save_config``), so both stepserve and ``mlx_lm.server`` load the directory as it is.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
from pathlib import Path
from typing import Any

#: Each shape's config.json keys (the vocabulary is the tokenizer's; see the module docstring).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "llama-1b": dict(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        num_hidden_layers=28,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "qwen3-moe": dict(
        model_type="qwen3_moe",
        hidden_size=512,
        num_hidden_layers=48,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    "qwen3-next": dict(
        model_type="qwen3_next",
        hidden_size=512,
        num_hidden_layers=48,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_value_heads=8,
        linear_num_key_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        num_experts=16,
        num_experts_per_tok=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=10000000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=262144,
        tie_word_embeddings=False,
    ),
    "gpt-oss": dict(
        model_type="gpt_oss",
        hidden_size=512,
        num_hidden_layers=24,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=16,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        rms_norm_eps=1e-5,
        rope_theta=150000,
        max_position_embeddings=131072,
    ),
}

#: The tokenizer files copied from ``--tokenizer-from`` when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def write(
    out: Path, shape: str, tokenizer_from: Path, bits: int = 4, group_size: int = 64, dtype: str = "float16"
) -> int:
    """Write the random model ``shape`` (:data:`SHAPES`) to the new directory ``out``.

    Returns:
        The parameter count (before quantization).

    Raises:
        FileExistsError: ``out`` exists.
        FileNotFoundError: ``tokenizer_from`` has no ``config.json`` or ``tokenizer.json``.
        KeyError: an unknown shape.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_config, save_model

    source = json.loads((tokenizer_from / "config.json").read_text())
    if not (tokenizer_from / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{tokenizer_from / 'tokenizer.json'}: the tokenizer to copy is missing")
    config = {**SHAPES[shape], "vocab_size": source["vocab_size"], "eos_token_id": source.get("eos_token_id")}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    out.mkdir(parents=True)
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    count = sum(v.size for _, v in tree_flatten(model.parameters()) if isinstance(v, mx.array))
    if bits:
        nn.quantize(model, group_size=group_size, bits=bits)
        config["quantization"] = {"group_size": group_size, "bits": bits}
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    return count


def main(argv: list[str]) -> int:
    """``stepserve bench random-model ARGV``: write the directory and print its parameter count."""
    parser = argparse.ArgumentParser(
        prog="stepserve bench random-model", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="the new model directory")
    parser.add_argument("--tokenizer-from", type=Path, required=True, help="a model directory (its tokenizer)")
    parser.add_argument("--bits", type=int, choices=(0, 4, 8), default=4, help="0: not quantized")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16")
    args = parser.parse_args(argv)
    count = write(args.out, args.shape, args.tokenizer_from, args.bits, args.group_size, args.dtype)
    print(f"{args.out}: {args.shape}, {count / 1e9:.2f}B parameters, {args.bits or args.dtype} bits")
    return 0
