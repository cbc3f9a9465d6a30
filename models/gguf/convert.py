"""``stepserve convert GGUF OUT_DIR``: write an mlx-community-format directory from a GGUF.

Quantized tensors stay quantized where MLX's affine format holds them exactly (MLX reads
Q4_0/Q4_1 as 4-bit and Q8_0 as 8-bit affine, group 32); a file MLX cannot read (K-quants,
Q5_0: Gemma 3's) is dequantized by the ``gguf`` package and written dense, the values the
server computes with (re-quantizing them to MLX's format changes the logits by up to ~9:
docs/ARCHITECTURE.md). A Llama file's Q/K row permutation is undone, so the result uses the
Hugging Face layout (non-interleaved RoPE) that mlx-lm and transformers expect; a Gemma 3
file's norm weights, stored as 1 + w, are written as w. The tokenizer is written as
``tokenizer.json`` and the chat template into ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, processors

from models.gemma3_text import unshift_norms
from models.gguf import gemma3
from models.gguf.reader import GGUF_GROUP_SIZE, args_from_metadata, params_from_tensors, read_gguf, scalar_metadata
from models.gguf.vocab import tokenizer_from_gguf
from models.layers import Params, quantized_bits
from models.model_args import ModelArgs
from models.tokenizer import ChatTokenizer


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K permutation (convert_hf_to_gguf.py ``LlamaModel.permute``), which
    maps Hugging Face rows ``reshape(n_heads, 2, D/2)`` to ``(n_heads, D/2, 2)``. Works on
    any [rows, ...] array whose rows are output features: quantized weights, scales, biases."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(gguf: str | Path, out_dir: str | Path, dtype: mx.Dtype | None = None) -> Path:
    """Convert a Llama-family GGUF into ``out_dir`` (created). Returns ``out_dir``.

    ``dtype`` casts the floating tensors (norms, scales, biases, unquantized weights), e.g.
    to float32 for serving on a CPU; None keeps the GGUF's.

    Raises:
        ModelLoadError: the GGUF is missing, unreadable or unsupported.
    """
    gguf, out = Path(gguf), Path(out_dir)
    tensors, metadata = read_gguf(gguf)
    args = args_from_metadata(metadata, tensors, gguf)
    params = params_from_tensors(tensors, args, gguf)
    tokenizer = tokenizer_from_gguf(metadata, gguf)
    gemma = args.model_type == gemma3.MODEL_TYPE
    for layer in params["layers"] if not gemma else ():
        attn = layer["self_attn"]
        for name, heads in (("q_proj", args.num_attention_heads), ("k_proj", args.num_key_value_heads)):
            attn[name] = {k: unpermute_rows(v, heads) for k, v in attn[name].items()}

    modules: dict[str, Params] = {}  # module path ("model.layers.0.self_attn.q_proj") -> its leaf dict
    for path, leaf in cast(list[tuple[str, Params]], tree_flatten(params, is_leaf=_is_module)):
        modules[("" if path == "lm_head" else "model.") + path] = leaf
    weights = {f"{path}.{k}": v for path, leaf in modules.items() for k, v in leaf.items()}
    if gemma:
        weights = unshift_norms(weights)
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    if gemma:
        config = gemma3.config_from_metadata(scalar_metadata(metadata), tensors, gguf) | _token_ids(tokenizer)
    else:
        config = _config(args, tokenizer)
    config |= _quantization(modules)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(tokenizer, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(args, tokenizer), indent=2))
    return out


def _save_tokenizer(tokenizer: ChatTokenizer, path: Path) -> None:
    """Write ``tokenizer.json``; when the model wants BOS before a raw prompt, with a
    post-processor that adds it, so that transformers (and mlx-lm) encode a prompt as the
    server does (``PreTrainedTokenizerFast`` adds special tokens only through it)."""
    tok = tokenizer.tokenizer
    if tokenizer.add_bos and tokenizer.bos_token_id is not None:
        bos = tok.id_to_token(tokenizer.bos_token_id)
        tok = Tokenizer.from_str(tok.to_str())  # a copy: the loaded tokenizer stays as it is
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)]
        )
    tok.save(str(path))


def _is_module(node: object) -> bool:
    return isinstance(node, dict) and "weight" in node


def _quantization(modules: dict[str, Params]) -> dict[str, Any]:
    """mlx-lm's ``quantization`` entry: the most common bit width, and an override per
    module path of any other; empty when nothing is quantized."""
    quantized = {path: quantized_bits(leaf, GGUF_GROUP_SIZE) for path, leaf in modules.items() if "scales" in leaf}
    if not quantized:
        return {}
    bits = Counter(quantized.values()).most_common(1)[0][0]
    quantization: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
    quantization.update({p: {"group_size": GGUF_GROUP_SIZE, "bits": b} for p, b in quantized.items() if b != bits})
    return {"quantization": quantization}


def _config(args: ModelArgs, tokenizer: ChatTokenizer) -> dict[str, Any]:
    """A Hugging Face ``config.json`` for ``args`` (LlamaForCausalLM)."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.dim_per_head,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position_embeddings,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        **_token_ids(tokenizer),
    }


def _token_ids(tokenizer: ChatTokenizer) -> dict[str, Any]:
    """``bos_token_id`` and ``eos_token_id`` (every stop id) of a ``config.json``."""
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": sorted(tokenizer.stop_token_ids)}


def _tokenizer_config(args: ModelArgs, tokenizer: ChatTokenizer) -> dict[str, Any]:
    """A Hugging Face ``tokenizer_config.json``: special tokens and the chat template."""
    token = tokenizer.tokenizer.id_to_token
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None,
        "eos_token": token(tokenizer.eos_token_id),
        "add_bos_token": tokenizer.add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": args.max_position_embeddings,
        "chat_template": tokenizer.chat_template,
    }
