"""``stepserve convert GGUF OUT_DIR``: write an mlx-community-format directory from a GGUF.

Quantized tensors stay quantized where MLX's affine format holds them exactly (MLX reads
Q4_0/Q4_1 as 4-bit and Q8_0 as 8-bit affine, group 32); a file MLX cannot read (K-quants,
Q5_0: Gemma 3's) is dequantized by the ``gguf`` package and written dense, the values the
server computes with (re-quantizing them to MLX's format changes the logits by up to ~9:
docs/ARCHITECTURE.md). A Llama file's Q/K row permutation is undone, so the result uses the
Hugging Face layout (non-interleaved RoPE) that mlx-lm and transformers expect; a Gemma 3
file's norm weights, stored as 1 + w, are written as w. The tokenizer is written as
``tokenizer.json`` and the chat template into ``tokenizer_config.json``.

The same mapping, kept in memory (:func:`gguf_checkpoint`), builds a GGUF file into mlx-lm's
classes for ``model_impl = "mlx_lm"`` (:func:`models.lm_loader.load_lm_gguf`); there a Llama
file keeps its permuted rows and says ``rope_traditional: true`` instead.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
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


@dataclass
class GGUFCheckpoint:
    """A GGUF file as an mlx-community checkpoint, in memory.

    Attributes:
        config: its ``config.json`` (``model_type`` ``llama`` or ``gemma3_text``; a
            ``quantization`` entry when tensors stay quantized).
        weights: tensors by Hugging Face name (``model.layers.0.self_attn.q_proj.weight``);
            quantized ones as MLX affine triples (``weight`` uint32, ``scales``, ``biases``).
        tokenizer: the tokenizer and chat template from the metadata.
        args: the hyper-parameters stepserve's reader derives (for ``tokenizer_config.json``).
    """

    config: dict[str, Any]
    weights: dict[str, mx.array]
    tokenizer: ChatTokenizer
    args: ModelArgs


def gguf_checkpoint(gguf: str | Path, dtype: mx.Dtype | None = None, llama_cpp_rows: bool = False) -> GGUFCheckpoint:
    """Read a GGUF file (:func:`models.gguf.reader.read_gguf`) and map it to mlx-community
    names and a ``config.json`` (the module docstring says how).

    Args:
        gguf: a Llama-family or Gemma 3 GGUF file.
        dtype: casts the floating tensors (norms, scales, biases, unquantized weights); None
            keeps the GGUF's.
        llama_cpp_rows: keep a Llama file's Q/K rows as llama.cpp permuted them and say
            ``rope_traditional: true`` in the config instead (mlx-lm's llama passes it to its
            RoPE, ``mx.fast.rope(traditional=True)`` rotating adjacent pairs, which is the
            permuted layout); the same logits as the Hugging Face layout without rewriting
            the rows. Gemma 3 files are not permuted (convert_hf_to_gguf.py's Gemma3Model).

    Raises:
        ModelLoadError: the GGUF is missing, unreadable or unsupported.
    """
    gguf = Path(gguf)
    tensors, metadata = read_gguf(gguf)
    args = args_from_metadata(metadata, tensors, gguf)
    params = params_from_tensors(tensors, args, gguf)
    tokenizer = tokenizer_from_gguf(metadata, gguf)
    gemma = args.model_type == gemma3.MODEL_TYPE
    for layer in params["layers"] if not (gemma or llama_cpp_rows) else ():
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
    if gemma:
        config = gemma3.config_from_metadata(scalar_metadata(metadata), tensors, gguf) | _token_ids(tokenizer)
    else:
        config = _config(args, tokenizer) | ({"rope_traditional": True} if llama_cpp_rows else {})
    config |= _quantization(modules)
    return GGUFCheckpoint(config, weights, tokenizer, args)


def convert_gguf(gguf: str | Path, out_dir: str | Path, dtype: mx.Dtype | None = None) -> Path:
    """Convert a Llama-family or Gemma 3 GGUF into ``out_dir`` (created): ``model.safetensors``,
    ``config.json``, ``tokenizer.json``, ``tokenizer_config.json``. Returns ``out_dir``.

    ``dtype`` casts the floating tensors (norms, scales, biases, unquantized weights), e.g.
    to float32 for serving on a CPU; None keeps the GGUF's.

    Raises:
        ModelLoadError: the GGUF is missing, unreadable or unsupported.
    """
    out = Path(out_dir)
    checkpoint = gguf_checkpoint(gguf, dtype)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), checkpoint.weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(checkpoint.config, indent=2))
    _save_tokenizer(checkpoint.tokenizer, out / "tokenizer.json")
    tokenizer_config = _tokenizer_config(checkpoint.args, checkpoint.tokenizer)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
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
