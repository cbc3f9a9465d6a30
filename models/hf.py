"""Load a Hugging Face / mlx-community model directory: ``config.json``, ``*.safetensors``
(sharded with ``model.safetensors.index.json`` or not), ``tokenizer.json``,
``tokenizer_config.json`` (or ``chat_template.jinja``) and ``generation_config.json``.

Quantized checkpoints use mlx-lm's format: ``quantization: {group_size, bits}`` in
``config.json`` with optional per-layer overrides keyed by module path, and each quantized
linear stored as ``weight`` (uint32), ``scales`` and ``biases``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
from mlx.utils import tree_unflatten
from tokenizers import Tokenizer

from models.architectures import UnsupportedArchitectureError
from models.architectures import architecture as _architecture
from models.errors import ModelLoadError
from models.layers import Params, quantized_bits
from models.model_args import ModelArgs
from models.tokenizer import ChatTokenizer


def architecture(model_type: str | None, path: Path) -> ModuleType:
    """The module for ``model_type``. Raises ModelLoadError listing the supported types."""
    try:
        return _architecture(model_type, path)
    except UnsupportedArchitectureError as exc:
        raise ModelLoadError(str(exc)) from exc


def _read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise ModelLoadError(
                f"{path} is missing; a model directory needs config.json, *.safetensors and tokenizer.json"
            )
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc})") from exc


def _check_quantization(config: dict, path: Path) -> None:
    """stepserve reads bits from tensor shapes but needs one group size per model."""
    quant = config.get("quantization")
    if not isinstance(quant, dict):
        return
    if quant.get("mode", "affine") != "affine":
        raise ModelLoadError(f"{path}: quantization mode '{quant['mode']}' is not supported; only MLX's affine mode")
    group = quant.get("group_size", 64)
    for key, value in quant.items():
        if isinstance(value, dict) and value.get("group_size", group) != group:
            raise ModelLoadError(
                f"{path}: layer '{key}' uses group size {value['group_size']}, the model {group}; "
                "mixed group sizes are not supported"
            )


def _check_quantized_bits(weights: dict[str, mx.array], config: dict[str, Any], file: Path) -> None:
    """Each quantized weight's bit width, read from its shapes at the config's group size
    (:func:`models.layers.quantized_bits`), must be the config's ``bits`` for its module: a
    wrong group size can give another valid width (4 bits at group 64 read as 8 at 32)."""
    quant = config.get("quantization")
    if not isinstance(quant, dict) or "bits" not in quant:
        return
    group = quant.get("group_size", 64)
    for key in weights:
        module = key.removesuffix(".scales")
        if module == key or f"{module}.weight" not in weights:
            continue
        override = quant.get(module)
        expected = override.get("bits", quant["bits"]) if isinstance(override, dict) else quant["bits"]
        try:
            bits = quantized_bits({"weight": weights[f"{module}.weight"], "scales": weights[key]}, group)
        except ValueError as exc:
            raise ModelLoadError(f"{file}: {module}: {exc}") from exc
        if bits != expected:
            raise ModelLoadError(
                f"{file}: {module} holds {bits}-bit weights at group size {group}, but the config says {expected} "
                "bits; its quantization settings do not match the weights"
            )


def read_weights(directory: Path) -> dict[str, mx.array]:
    """All tensors of the directory's safetensors files (every shard)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors files")
    weights: dict[str, mx.array] = {}
    for file in files:
        try:
            loaded = mx.load(str(file))
        except Exception as exc:
            raise ModelLoadError(
                f"{file} could not be read as safetensors ({exc}); the file is truncated or corrupt"
            ) from exc
        assert isinstance(loaded, dict)  # a safetensors file loads as {name: array}
        weights.update(loaded)
    return weights


def params_from_weights(weights: dict[str, mx.array], args: ModelArgs) -> Params:
    """``model.layers.0.self_attn.q_proj.weight`` ... -> the stepserve parameter tree."""
    items = [(k.removeprefix("model."), v) for k, v in weights.items()]
    tree = tree_unflatten(items)
    if not isinstance(tree.get("layers"), list) or len(tree["layers"]) != args.num_hidden_layers:
        raise ModelLoadError(f"expected {args.num_hidden_layers} layers in the checkpoint")
    return tree


def tokenizer_from_dir(directory: Path, config: dict) -> ChatTokenizer:
    """Tokenizer, chat template and stop ids of a model directory."""
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise ModelLoadError(f"{file} is missing; stepserve needs a tokenizers-format tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ModelLoadError(
            f"{file} could not be read as a tokenizers tokenizer.json ({exc}); the file is corrupt"
        ) from exc
    tok_config = _read_json(directory / "tokenizer_config.json", required=False)
    template = tok_config.get("chat_template")
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)

    def token_id(value: Any) -> int | None:
        if isinstance(value, dict):
            value = value.get("content")
        return tokenizer.token_to_id(value) if isinstance(value, str) else None

    eos_ids: set[int] = set()
    for source in (config, _read_json(directory / "generation_config.json", required=False)):
        eos = source.get("eos_token_id")
        eos_ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    eos = token_id(tok_config.get("eos_token"))
    if eos is not None:
        eos_ids.add(eos)
    if not eos_ids:
        raise ModelLoadError(
            f"{directory}: no end-of-sequence token in config.json, generation_config.json or tokenizer_config.json"
        )
    return ChatTokenizer(
        tokenizer=tokenizer,
        chat_template=template,
        bos_token_id=token_id(tok_config.get("bos_token")),
        eos_token_id=eos if eos is not None else min(eos_ids),
        add_bos=bool(tok_config.get("add_bos_token", False)),
        stop_token_ids=frozenset(eos_ids),
    )


def _args(module: ModuleType, config: dict[str, Any], file: Path) -> ModelArgs:
    """``module.ModelArgs.from_dict(config)``; its refusals become ModelLoadError naming ``file``."""
    try:
        return module.ModelArgs.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{file}: {exc}") from exc


#: Projections that carry a ``bias`` when the config's flag is true (Hugging Face's
#: LlamaAttention/LlamaMLP and mlx-lm's llama.Attention/MLP apply the flag to all of them).
_BIASED = {
    "attention_bias": ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    "mlp_bias": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def _check_tensors_present(params: Params, args: ModelArgs, config: dict[str, Any], file: Path) -> None:
    """Refuse a checkpoint that lacks what the config says the math uses: the biases of
    ``attention_bias``/``mlp_bias``, or ``lm_head`` when the embeddings are not tied
    (:func:`models.llama.prefill` would silently use the embeddings)."""
    missing = []
    for flag, (block, names) in _BIASED.items():
        if config.get(flag):
            missing += [
                f"layers.{i}.{block}.{name}.bias"
                for i, layer in enumerate(params["layers"])
                for name in names
                if "bias" not in layer.get(block, {}).get(name, {})
            ]
    if not args.tie_word_embeddings and "lm_head" not in params:
        missing.append("lm_head.weight")
    if missing:
        raise ModelLoadError(
            f"{file}: the config asks for tensors the checkpoint lacks: {missing[:5]}"
            f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}"
        )


def load_dir(directory: Path) -> tuple[ModelArgs, Params, ChatTokenizer]:
    """Read a model directory. Raises ModelLoadError naming the file and the problem."""
    file = directory / "config.json"
    config = _read_json(file)
    module = architecture(config.get("model_type"), file)
    _check_quantization(config, file)
    args = _args(module, config, file)  # refuses unimplemented keys before any weight is read
    weights = read_weights(directory)
    _check_quantized_bits(weights, config, file)
    if config.get("tie_word_embeddings") is None:  # tied when the checkpoint has no lm_head
        args = replace(args, tie_word_embeddings="lm_head.weight" not in weights)
    try:
        weights = module.sanitize(weights, args)
    except ValueError as exc:
        raise ModelLoadError(f"{directory}: {exc}") from exc
    params = params_from_weights(weights, args)
    _check_tensors_present(params, args, config, file)
    return args, params, tokenizer_from_dir(directory, config)
