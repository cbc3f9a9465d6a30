"""Load a model directory, or a GGUF file, through mlx-lm's own construction, for the adapter's steps.

mlx-lm builds the module: ``load_config`` reads ``config.json`` (and the generation config's
stop ids), ``_get_classes`` picks the architecture module (with mlx-lm's remapping of aliases,
e.g. ``mistral`` -> ``llama``), ``load_model`` runs the module's ``sanitize`` on every shard's
tensors and quantizes the layers the quantization config names. stepserve then casts it to the
compute dtype (expanding quantized layers first with ``weights = "dequantized"``), learns its
cache layouts (:meth:`models.adapter.AdapterArgs.from_module`) and reads the tokenizer itself
(:func:`models.hf.tokenizer_from_dir`). A GGUF file is mapped to the same checkpoint by
``stepserve convert``'s code and built into the same classes (:func:`load_lm_gguf`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes, dequantize_model, infer_quant_config, load_config
from mlx_lm.utils import load_model as lm_load_model

from models.adapter import AdapterArgs
from models.adapter.support import REFUSED, check_supported
from models.architectures import ARCHITECTURES
from models.errors import ModelLoadError
from models.gguf.convert import gguf_checkpoint
from models.hf import tokenizer_from_dir
from models.tokenizer import ChatTokenizer

#: Which implementation serves a model: ``auto`` (the hand-written module where one exists for
#: the directory's ``model_type``, else mlx-lm's class), ``native`` or ``mlx_lm``.
ModelImpl = Literal["auto", "native", "mlx_lm"]


def uses_mlx_lm(path: Path, impl: ModelImpl) -> bool:
    """Whether ``path`` is served through mlx-lm's class (see :data:`ModelImpl`). A GGUF file
    is served through it with ``mlx_lm`` only: ``auto`` keeps both GGUF architectures
    stepserve reads (Llama-family, Gemma 3) on their hand-written modules."""
    if impl == "native":
        return False
    if impl == "mlx_lm":
        return True
    if not path.is_dir():
        return False
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False  # the native loader names the problem
    return model_type not in ARCHITECTURES


def module_name(config: dict) -> str:
    """The mlx-lm architecture module ``config`` is built with (after mlx-lm's remapping).

    Raises:
        ModelLoadError: mlx-lm has no module for its ``model_type``.
    """
    try:
        model_class, _ = _get_classes(config)
    except (KeyError, ValueError, ImportError, SystemExit) as exc:  # a module may exit at import (olmo)
        raise ModelLoadError(
            f"model_type '{config.get('model_type')}' is not supported: mlx-lm has no module for it; "
            "'stepserve models' lists the supported types"
        ) from exc
    return model_class.__module__.rsplit(".", 1)[-1]


def load_lm_dir(
    directory: Path, dtype: mx.Dtype, weights: Literal["quantized", "dequantized"]
) -> tuple[AdapterArgs, nn.Module, ChatTokenizer]:
    """Build ``directory``'s mlx-lm module in ``dtype`` and learn its caches.

    Args:
        directory: an mlx-community / Hugging Face directory (``config.json``,
            ``model*.safetensors``, ``tokenizer.json``).
        dtype: compute dtype: every floating parameter is cast to it (quantized weights stay
            uint32; their scales and biases take it).
        weights: ``dequantized`` expands quantized layers to dense ones (mlx-lm's
            ``dequantize_model``) before the cast.

    Returns:
        (the adapter's args, the module with its parameters evaluated, the tokenizer).

    Raises:
        ModelLoadError: naming ``directory``: a missing or unreadable file, a ``model_type``
            the adapter does not serve (:func:`models.adapter.support.check_supported`), or a
            cache it cannot hold.
    """
    config_file = directory / "config.json"
    try:
        config = load_config(directory)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_file} could not be read ({exc})") from exc
    model_type = str(config.get("model_type"))
    try:
        if model_type in REFUSED:  # before importing its module: some exit at import (olmo without its package)
            check_supported(model_type)
        check_supported(module_name(config))
        module, config = lm_load_model(directory, lazy=True)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{config_file}: {exc}") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{directory}: mlx-lm could not build model_type '{model_type}' ({exc})") from exc
    args = _served_module(module, model_type, dtype, weights, config_file)
    return args, module, tokenizer_from_dir(directory, json.loads(config_file.read_text()))


def load_lm_gguf(
    path: Path, dtype: mx.Dtype, weights: Literal["quantized", "dequantized"]
) -> tuple[AdapterArgs, nn.Module, ChatTokenizer]:
    """Build a GGUF file's mlx-lm module (``llama`` for Llama-family files, ``gemma3_text`` for
    Gemma 3) in ``dtype`` and learn its caches, as :func:`load_lm_dir` does for a directory.

    The file is read and mapped by ``stepserve convert``'s code
    (:func:`models.gguf.convert.gguf_checkpoint`), in memory: Hugging Face tensor names, a
    ``config.json`` from the GGUF's hyper-parameters, llama.cpp's permuted Q/K rows kept with
    ``rope_traditional: true``. mlx-lm's classes are then built as its ``load_model`` builds
    them: the module's ``sanitize``, each quantized layer quantized at the group size and bits
    its tensors were packed with (``mlx_lm.utils.infer_quant_config``: Q4_0/Q4_1 as 4-bit,
    Q8_0 as 8-bit, group 32), the weights loaded strictly. Tensors MLX cannot read (K-quants,
    Q5_0) arrive dense from the ``gguf`` package and stay dense.

    Args:
        path: the GGUF file.
        dtype: compute dtype (quantized weights stay uint32; their scales and biases take it).
        weights: ``dequantized`` expands quantized layers to dense ones before the cast.

    Returns:
        (the adapter's args, the module with its parameters evaluated, the GGUF's tokenizer).

    Raises:
        ModelLoadError: naming ``path``: unreadable or unsupported (the GGUF reader's messages),
            a tensor the module does not take, or a cache the adapter cannot hold.
    """
    checkpoint = gguf_checkpoint(path, llama_cpp_rows=True)
    config = checkpoint.config
    model_type = str(config["model_type"])
    try:
        check_supported(module_name(config))
        model_class, args_class = _get_classes(config)
        module = model_class(args_class.from_dict(config))
        tensors = module.sanitize(checkpoint.weights)

        def packed(layer: str, m: nn.Module) -> bool | dict:
            return hasattr(m, "to_quantized") and f"{layer}.scales" in tensors and infer_quant_config(layer, m, tensors)

        nn.quantize(module, class_predicate=packed)
        module.eval()
        module.load_weights(list(tensors.items()))
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: mlx-lm could not build model_type '{model_type}' from it ({exc})") from exc
    return _served_module(module, model_type, dtype, weights, path), module, checkpoint.tokenizer


def _served_module(
    module: nn.Module, model_type: str, dtype: mx.Dtype, weights: Literal["quantized", "dequantized"], source: Path
) -> AdapterArgs:
    """Expand (``weights = "dequantized"``), cast and read ``module``'s parameters, and learn its
    caches. Raises ModelLoadError naming ``source`` (the file the module came from): a weight
    that cannot be read, a cache the adapter cannot hold."""
    if weights == "dequantized":
        module = dequantize_model(module)
    module.set_dtype(dtype)
    try:
        mx.eval(module.parameters())
    except Exception as exc:  # a truncated file fails here, when the bytes are read
        raise ModelLoadError(
            f"{source}: the weights could not be read ({exc}); a file is truncated or corrupt"
        ) from exc
    try:
        args = AdapterArgs.from_module(module, model_type)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{source}: model_type '{model_type}': {exc}") from exc
    return args
