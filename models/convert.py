"""``stepserve convert GGUF OUT_DIR``: write an mlx-community-format directory from a GGUF.

Quantized tensors stay quantized where MLX's affine format holds them exactly (MLX reads
Q4_0/Q4_1 as 4-bit and Q8_0 as 8-bit affine, group 32); llama.cpp's Q/K row permutation
is undone, so the result uses the Hugging Face layout (non-interleaved RoPE) that mlx-lm
and transformers expect; the tokenizer is written as ``tokenizer.json`` and the chat
template into ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from models.gguf import GGUF_GROUP_SIZE, args_from_metadata, params_from_tensors, read_gguf
from models.tokenizer import ChatTokenizer


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K permutation (convert_hf_to_gguf.py ``LlamaModel.permute``), which
    maps Hugging Face rows ``reshape(n_heads, 2, D/2)`` to ``(n_heads, D/2, 2)``. Works on
    any [rows, ...] array whose rows are output features: quantized weights, scales, biases."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _bits(leaf: dict) -> int:
    return leaf["weight"].shape[-1] * 32 // (leaf["scales"].shape[-1] * GGUF_GROUP_SIZE)


def convert_gguf(gguf: str | Path, out_dir: str | Path, dtype: mx.Dtype | None = None) -> Path:
    """Convert a Llama-family GGUF into ``out_dir`` (created). Returns ``out_dir``.

    ``dtype`` casts the floating tensors (norms, scales, biases, unquantized weights), e.g.
    float32 for a CPU, where float16 compute is slow; None keeps the GGUF's.

    Raises:
        ModelLoadError: the GGUF is missing, unreadable or unsupported.
    """
    gguf, out = Path(gguf), Path(out_dir)
    tensors, metadata = read_gguf(gguf)
    args = args_from_metadata(metadata, tensors, gguf)
    tokenizer = ChatTokenizer.from_gguf_metadata(metadata, gguf)
    params = params_from_tensors(tensors, args, gguf)
    for layer in params["layers"]:
        attn = layer["self_attn"]
        for name, heads in (("q_proj", args.num_attention_heads), ("k_proj", args.num_key_value_heads)):
            attn[name] = {k: unpermute_rows(v, heads) for k, v in attn[name].items()}

    modules = {}  # module path -> its leaf dict, for quantization bookkeeping
    for path, leaf in tree_flatten(params, is_leaf=lambda x: isinstance(x, dict) and "weight" in x):
        modules[("" if path == "lm_head" else "model.") + path] = leaf
    quantized = {path: _bits(leaf) for path, leaf in modules.items() if "scales" in leaf}
    quantization = None
    if quantized:
        bits = Counter(quantized.values()).most_common(1)[0][0]
        quantization = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
        quantization.update({p: {"group_size": GGUF_GROUP_SIZE, "bits": b} for p, b in quantized.items() if b != bits})

    weights = {f"{path}.{k}": v for path, leaf in modules.items() for k, v in leaf.items()}
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {
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
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": sorted(tokenizer.stop_token_ids),
        **({"quantization": quantization} if quantization else {}),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    token = tokenizer.tokenizer.id_to_token
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None,
        "eos_token": token(tokenizer.eos_token_id),
        "add_bos_token": tokenizer.add_bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": args.max_position_embeddings,
        "chat_template": tokenizer.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return out
