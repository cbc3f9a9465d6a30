"""Read a GGUF file (architectures ``llama`` and ``gemma3``) into :class:`ModelArgs` and a
stepserve parameter tree.

``mx.load(path, return_metadata=True)`` does the file parsing when every tensor is of a type
MLX reads: it returns Q4_0, Q4_1 and Q8_0 tensors as affine-quantized triples (``weight``
uint32, ``scales``, ``biases``; group size 32, the GGUF block size) and F32/F16 ones dense.
A file with other types (K-quants, Q5_0, ...) is read by :mod:`models.gguf.quants` instead,
with llama.cpp's ``gguf`` package. The metadata keys are those of the GGUF specification
(ggml/docs/gguf.md): ``{arch}.block_count``, ``{arch}.attention.head_count`` and so on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from models.config_check import unimplemented_gguf
from models.errors import ModelLoadError
from models.gguf import gemma3, quants
from models.gguf.header import GGUFLayoutError, check_gguf_layout, read_gguf_header
from models.gguf.vocab import tokenizer_from_gguf
from models.layers import Params
from models.model_args import ModelArgs
from models.tokenizer import ChatTokenizer

GGUF_GROUP_SIZE = 32  # values per Q4_0 / Q4_1 / Q8_0 block (ggml-common.h: QK4_0, QK8_0)
SUPPORTED_ARCHITECTURES = ("llama", "gemma3")

_LAYER_NAMES = {
    "attn_norm": ("input_layernorm",),
    "attn_q": ("self_attn", "q_proj"),
    "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"),
    "ffn_norm": ("post_attention_layernorm",),
    "ffn_gate": ("mlp", "gate_proj"),
    "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}
#: Layer tensors a file may carry that the math does not use: ``attn_rot_embd``, the default
#: RoPE inverse frequencies that old converters stored (mlx-lm's sanitize drops the same).
_UNUSED_LAYER_TENSORS = ("attn_rot_embd",)
_TOP_NAMES = {"token_embd": ("embed_tokens",), "output_norm": ("norm",), "output": ("lm_head",)}


def load_gguf(path: Path) -> tuple[ModelArgs, Params, ChatTokenizer]:
    """A GGUF file's hyper-parameters, parameter tree (as the file stores it: see
    :func:`read_gguf`) and tokenizer, as :func:`models.hf.load_dir` returns a directory's.

    Raises:
        ModelLoadError: the file is missing, unreadable or unsupported (the message names it).
    """
    tensors, metadata = read_gguf(path)
    args = args_from_metadata(metadata, tensors, path)
    return args, params_from_tensors(tensors, args, path), tokenizer_from_gguf(metadata, path)


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Load a GGUF file's tensors and metadata: with ``mx.load`` when MLX reads every tensor
    type, else with the ``gguf`` package (:func:`models.gguf.quants.read_tensors`: every tensor
    dequantized to float32; :func:`requantize` then stores it as the loader chooses).

    Raises:
        ModelLoadError: the file does not exist, is damaged, or cannot be parsed; or it needs
            the ``gguf`` package and that is not installed.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file {path} does not exist; pass --model PATH to a GGUF file or a model directory")
    try:  # MLX's reader segfaults on damaged metadata: check the layout first
        layout = check_gguf_layout(path)
        if any(t.ggml_type not in quants.MLX_READABLE_TYPES for t in layout.tensors):
            header = read_gguf_header(path)
            return quants.read_tensors(path, header), header.metadata
    except GGUFLayoutError as exc:
        raise ModelLoadError(f"model file {path} is corrupt or not GGUF: {exc}; download or reinstall it") from exc
    try:
        loaded = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises ValueError/RuntimeError for damaged files
        raise ModelLoadError(
            f"model file {path} could not be read as GGUF ({exc}); the file is truncated or "
            f"corrupt: download or reinstall it"
        ) from exc
    assert isinstance(loaded, tuple)  # return_metadata=True: (arrays, metadata)
    return loaded


def scalar_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` with one-element arrays (numeric GGUF values) as Python scalars."""
    return {k: v.item() if isinstance(v, mx.array) and v.size == 1 else v for k, v in metadata.items()}


def args_from_metadata(metadata: dict[str, Any], tensors: dict[str, mx.array], path: Path) -> ModelArgs:
    """Translate GGUF hyper-parameter keys to :class:`ModelArgs`.

    Raises:
        ModelLoadError: the architecture is not a supported Llama-family one, a required
            key is missing, or the file asks for something not implemented
            (:func:`models.config_check.unimplemented_gguf`; the message names the keys).
    """
    meta = scalar_metadata(metadata)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture '{arch}' is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if arch == "gemma3":
        return gemma3.args_from_metadata(meta, tensors, path)
    try:
        heads = int(meta[f"{arch}.attention.head_count"])
        hidden = int(meta[f"{arch}.embedding_length"])
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
        args = ModelArgs(
            model_type=arch,
            hidden_size=hidden,
            num_hidden_layers=int(meta[f"{arch}.block_count"]),
            intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            vocab_size=int(tensors["token_embd.weight"].shape[0]),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            # llama.cpp's converter permutes Q/K rows into the interleaved layout.
            rope_traditional=True,
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensors,
            head_dim=head_dim,
            quant_group_size=GGUF_GROUP_SIZE,
        )
    except (KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: GGUF metadata lacks a required key ({exc})") from exc
    problems = unimplemented_gguf(meta, tensors, arch, head_dim)
    if problems:
        raise ModelLoadError(f"{path}: " + "; ".join(problems))
    return args


def params_from_tensors(tensors: dict[str, mx.array], args: ModelArgs, path: Path) -> Params:
    """Arrange GGUF tensors (``blk.N.attn_q.weight`` ...) into the stepserve parameter tree
    (``layers[N]["self_attn"]["q_proj"]["weight"]`` ..., the mlx-lm names).

    Raises:
        ModelLoadError: a tensor the architecture needs is missing, or the file has tensors
            it does not use (they would change the math: MoE experts, extra norms, ...).
    """
    names = gemma3.LAYER_NAMES if args.model_type == gemma3.MODEL_TYPE else _LAYER_NAMES
    layers: list[Params] = [{} for _ in range(args.num_hidden_layers)]
    tree: Params = {"layers": layers}
    unknown = []
    for name, value in tensors.items():
        stem, _, leaf = name.rpartition(".")
        _, index, kind = stem.split(".", 2) if stem.startswith("blk.") else ("", "", "")
        if kind in names and int(index) < len(layers):
            node, route = layers[int(index)], names[kind]
        elif stem in _TOP_NAMES:
            node, route = tree, _TOP_NAMES[stem]
        else:
            if kind not in _UNUSED_LAYER_TENSORS:
                unknown.append(name)
            continue
        for key in route:
            node = node.setdefault(key, {})
        node[leaf] = value
    if unknown:
        raise ModelLoadError(
            f"{path}: GGUF tensors {unknown[:5]} are not part of stepserve's {args.model_type}; "
            "the file is of a variant that is not implemented"
        )
    missing = [k for k in ("embed_tokens", "norm") if k not in tree]
    missing += [
        f"blk.{i}.{kind}" for i, layer in enumerate(layers) for kind, route in names.items() if not _has(layer, route)
    ]
    if missing:
        raise ModelLoadError(f"{path}: GGUF file lacks tensors {missing[:5]}; the file is incomplete")
    return tree


def _has(node: Params, route: tuple[str, ...]) -> bool:
    for key in route:
        if key not in node:
            return False
        node = node[key]
    return True
