"""Load a model directory through mlx-lm's own construction, for the adapter's steps.

mlx-lm builds the module: ``load_config`` reads ``config.json`` (and the generation config's
stop ids), ``_get_classes`` picks the architecture module (with mlx-lm's remapping of aliases,
e.g. ``mistral`` -> ``llama``), ``load_model`` runs the module's ``sanitize`` on every shard's
tensors and quantizes the layers the quantization config names. stepserve then casts it to the
compute dtype (expanding quantized layers first with ``weights = "dequantized"``), learns its
cache layouts (:meth:`models.adapter.AdapterArgs.from_module`) and reads the tokenizer itself
(:func:`models.hf.tokenizer_from_dir`). A GGUF file is mapped to the same checkpoint by
``stepserve convert``'s code and built into the same classes (:func:`load_lm_gguf`).

**Pipeline stages.** A module whose layers sit in mlx-lm's ``PipelineMixin`` (its
``pipeline(group, split)`` keeps a contiguous slice of layers per rank; its ``__call__``
receives the hidden states from the rank above, sends its own to the rank below and
all-gathers the last stage's, so every rank computes the logits) is one stage of a pipeline
group: :func:`lm_layout` gives the split its bytes from the shapes alone, and
:func:`load_lm_dir` with a group keeps the rank's layers (and the embedding, final norm and
head, which every rank runs) and reads only those weights. Its caches are its own layers'
(mlx-lm's ``make_prompt_cache`` follows ``pipeline_layers``). A module without
``PipelineMixin`` is refused for a group, named (:func:`pipeline_part`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.pipeline import PipelineMixin
from mlx_lm.utils import _get_classes, dequantize_model, infer_quant_config, load_config
from mlx_lm.utils import load_model as lm_load_model

from models.adapter import AdapterArgs
from models.adapter.support import PIPELINE_SPLITS, REFUSED, check_supported
from models.errors import ModelLoadError
from models.gguf.convert import gguf_checkpoint
from models.hf import tokenizer_from_dir
from models.pipeline import Stage, plan_stages
from models.tokenizer import ChatTokenizer


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
    directory: Path,
    dtype: mx.Dtype,
    weights: Literal["quantized", "dequantized"],
    group: mx.distributed.Group | None = None,
    split: list[int] | None = None,
) -> tuple[AdapterArgs, nn.Module, ChatTokenizer]:
    """Build ``directory``'s mlx-lm module in ``dtype`` and learn its caches.

    Args:
        directory: an mlx-community / Hugging Face directory (``config.json``,
            ``model*.safetensors``, ``tokenizer.json``).
        dtype: compute dtype: every floating parameter is cast to it (quantized weights stay
            uint32; their scales and biases take it).
        weights: ``dequantized`` expands quantized layers to dense ones (mlx-lm's
            ``dequantize_model``) before the cast, in float32 (its scales and biases cast
            first), as :func:`models.loader.prepare_params` does.
        group: the pipeline group this process is one rank of (the group ``mx.distributed``
            initialized, which mlx-lm's stages talk over), or None for the whole model.
        split: with ``group``, the layers of each rank, indexed by rank (rank r runs the
            layers after those of ranks r+1..size-1: mlx-lm's ``PipelineMixin.pipeline``).

    Returns:
        (the adapter's args, the module with its parameters evaluated, the tokenizer); with a
        group, the module holds and runs this rank's stage and the args' layouts are its
        layers' caches.

    Raises:
        ModelLoadError: naming ``directory``: a missing or unreadable file, a ``model_type``
            the adapter does not serve (:func:`models.adapter.support.check_supported`), a
            cache it cannot hold, or (with a group) a module whose layers do not split
            (:func:`pipeline_part`). (Recurrent layers that ignore padding, ``pads_prompts``
            False, are served: the engine prefills their prompts in exact rows,
            :func:`service.engine.prefill.chunk_plan`.)
    """
    module, config_file, model_type = _build(directory)
    part = None
    if group is not None:
        part = pipeline_part(module, model_type)
        try:
            part.pipeline(group, split)
        except ValueError as exc:
            raise ModelLoadError(f"{config_file}: model_type '{model_type}': {exc}") from exc
    module = _cast(module, dtype, weights)
    args = _served(module, model_type, config_file, part)
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
    module = _cast(module, dtype, weights)
    return _served(module, model_type, path), module, checkpoint.tokenizer


def _served(module: nn.Module, model_type: str, source: Path, part: PipelineMixin | None = None) -> AdapterArgs:
    """Read ``module``'s (cast) parameters and learn its caches (a pipeline stage's ``part``: its
    layers only, probed alone). Raises ModelLoadError naming ``source``, the file the module came
    from: a weight that cannot be read, a cache the adapter cannot hold."""
    try:
        mx.eval(module.parameters())  # a stage: its layers and the ends only (the rest stays unread)
    except Exception as exc:  # a truncated file fails here, when the bytes are read
        raise ModelLoadError(
            f"{source}: the weights could not be read ({exc}); a file is truncated or corrupt"
        ) from exc
    try:
        with _alone(part):  # the probes run this stage's layers in this process only
            return AdapterArgs.from_module(module, model_type)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{source}: model_type '{model_type}': {exc}") from exc


def _build(directory: Path) -> tuple[nn.Module, Path, str]:
    """(``directory``'s mlx-lm module with lazy weights, its config file, its ``model_type``).

    Raises:
        ModelLoadError: see :func:`load_lm_dir`.
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
        module, _ = lm_load_model(directory, lazy=True)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{config_file}: {exc}") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{directory}: mlx-lm could not build model_type '{model_type}' ({exc})") from exc
    return module, config_file, model_type


def _cast(module: nn.Module, dtype: mx.Dtype, weights: Literal["quantized", "dequantized"]) -> nn.Module:
    """``module`` expanded (``dequantized``, in float32) and cast to ``dtype``, lazily."""
    if weights == "dequantized":
        module.set_dtype(mx.float32)  # the scales and biases: the expansion then runs in float32
        module = dequantize_model(module)
    module.set_dtype(dtype)
    return module


def pipeline_part(module: nn.Module, model_type: str) -> PipelineMixin:
    """The submodule of ``module`` whose layers mlx-lm splits into pipeline stages (its one
    ``PipelineMixin``), for an architecture of :data:`models.adapter.support.PIPELINE_SPLITS`.

    Raises:
        ModelLoadError: naming ``model_type`` and why: its mlx-lm module has no
            ``PipelineMixin`` (its forward pass has no stage boundary to send hidden states
            across), or its caches do not follow a stage's layers.
    """
    name = type(module).__module__.removeprefix("mlx_lm.models.")
    parts = [m for m in module.modules() if isinstance(m, PipelineMixin)]
    if len(parts) == 1 and name in PIPELINE_SPLITS:
        return parts[0]
    why = (
        f"mlx-lm's {name} has no PipelineMixin (its forward pass cannot run a slice of its layers)"
        if not parts
        else f"mlx-lm's {name} keeps caches for layers outside a stage"
    )
    raise ModelLoadError(
        f"--distributed: model_type '{model_type}' cannot be split into pipeline stages: {why}; serve it in "
        "one process (or, for a hand-written type, set model_impl = 'native'); `stepserve models` lists the "
        "types that split"
    )


@contextmanager
def _alone(part: PipelineMixin | None) -> Iterator[None]:
    """Run ``part``'s stage as if it were the whole pipeline (no send, receive or gather) for
    the eager probes of one process; restored on exit."""
    if part is None:
        yield
        return
    rank, size = part.pipeline_rank, part.pipeline_size
    part.pipeline_rank, part.pipeline_size = 0, 1
    try:
        yield
    finally:
        part.pipeline_rank, part.pipeline_size = rank, size


@dataclass(frozen=True)
class LmLayout:
    """What the pipeline split needs of an mlx-lm module, in bytes as served.

    Attributes:
        model_type: the checkpoint's ``model_type``.
        layer_bytes: each layer's parameters.
        shared_bytes: the rest (embedding, final norm, head), which every rank holds.
    """

    model_type: str
    layer_bytes: list[int]
    shared_bytes: int

    def split(self, size: int, capacities: Sequence[float] | None = None) -> list[Stage]:
        """:func:`models.pipeline.plan_stages` of the layers over ``size`` ranks, each holding
        the shared bytes too."""
        return plan_stages(
            self.layer_bytes, 0, 0, size, tied=False, capacities=capacities, shared_bytes=self.shared_bytes
        )


def lm_layout(directory: Path, dtype: mx.Dtype, weights: Literal["quantized", "dequantized"]) -> LmLayout:
    """Each layer's and the shared parts' bytes once cast for serving, from the shapes alone
    (no weight is read).

    Raises:
        ModelLoadError: see :func:`load_lm_dir` (a module whose layers do not split included).
    """
    if not directory.is_dir():
        raise ModelLoadError(
            f"--distributed: {directory} is not a model directory: a GGUF file served through mlx-lm's classes "
            "cannot be split into pipeline stages; convert it with 'stepserve convert' and serve the directory"
        )
    module, _, model_type = _build(directory)
    part = pipeline_part(module, model_type)
    module = _cast(module, dtype, weights)
    layers = [_nbytes(layer) for layer in part.layers]
    return LmLayout(model_type, layers, _nbytes(module) - sum(layers))


def _nbytes(module: nn.Module) -> int:
    return sum(a.nbytes for _, a in tree_flatten(module.parameters()) if isinstance(a, mx.array))
