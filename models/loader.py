"""Load a model file into everything the engine needs: args, parameters, tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from models.adapter import AdapterArgs
from models.architectures import ModelImpl, uses_mlx_lm
from models.errors import ModelLoadError
from models.fuse import fuse_projections
from models.gguf.reader import load_gguf
from models.hf import load_dir
from models.layers import Params, quantized_bits
from models.model_args import ModelArgs
from models.pipeline import Stage
from models.tokenizer import ChatTokenizer

WeightsMode = Literal["quantized", "dequantized"]

#: A served model's hyper-parameters: a hand-written architecture's, or an mlx-lm module's
#: run through :mod:`models.adapter` (both answer what the engine asks: layers, vocabulary,
#: ``windows``, ``kv_bytes``, ``can_verify``, ``has_states``, ``prefix_blocks``, widths).
ServedArgs = ModelArgs | AdapterArgs


def device_name() -> str:
    """``cpu`` or ``gpu`` (Metal on a Mac, CUDA on Linux): MLX's default device type."""
    return "gpu" if mx.default_device().type == mx.gpu else "cpu"


@dataclass
class LoadedModel:
    """A model ready for the step functions.

    Attributes:
        name: the name clients send as ``model``.
        path: the file it came from.
        args: hyper-parameters: a hand-written architecture's :class:`ModelArgs`, or
            :class:`models.adapter.AdapterArgs` for an mlx-lm module (whose step functions
            are :mod:`models.adapter`'s).
        params: parameter tree in the compute dtype (quantized weights stay uint32); an
            mlx-lm module's ``parameters()``.
        tokenizer: tokenizer, chat template and stop ids.
        dtype: compute dtype (activations, KV cache, scales).
        weights: "quantized" (quantized matmuls) or "dequantized" (dense matmuls).
        load_seconds: wall time to read and prepare the weights.
        stage: the pipeline stage this process serves (its layers only in ``params``,
            :func:`models.stage_loader.load_stage`); None: the whole model.
        group: the ``mx.distributed`` group of the stages (None for the whole model).
    """

    name: str
    path: Path
    args: ServedArgs
    params: Params
    tokenizer: ChatTokenizer
    dtype: mx.Dtype
    weights: WeightsMode
    load_seconds: float
    stage: Stage | None = None
    group: mx.distributed.Group | None = None

    @property
    def layers(self) -> int:
        """Decoder layers this process holds (and keeps a KV cache for): all of them, or its stage's."""
        return self.args.num_hidden_layers if self.stage is None else self.stage.stop - self.stage.start

    @cached_property
    def nbytes(self) -> int:
        """Bytes of all parameters, counted once: ``params`` is not replaced after loading, and
        memory admission (:func:`service.process.memory.admit`) asks for it on every request."""
        # Without a ``destination``, tree_flatten returns the list of its union return type.
        leaves = cast(list[tuple[str, mx.array]], tree_flatten(self.params))
        return sum(leaf.nbytes for _, leaf in leaves)


def prepare_params(params: Params, dtype: mx.Dtype, weights: WeightsMode, group_size: int) -> Params:
    """Cast float leaves to ``dtype``; with ``weights="dequantized"`` expand quantized triples.

    Quantized ``weight`` (uint32) leaves are kept as they are; their ``scales`` and
    ``biases`` take the compute dtype, as the activations do. An expanded weight is
    ``scale * q + bias`` computed in float32 and then cast to ``dtype``, as llama.cpp expands
    a GGUF block (``dequantize_row_q4_1``: ``y = d * q + m`` in float from float16 ``d``, ``m``)
    and as MLX's quantized matmul with float32 scales computes it (float16 arithmetic would
    round each weight to float16 first; on the CPU it is also several times slower).

    Raises:
        ValueError: a quantized triple's shapes fit no MLX bit width at ``group_size``
            (:func:`models.layers.quantized_bits`).
    """

    def expand(node):
        if isinstance(node, dict):
            if "scales" in node:
                bits = quantized_bits(node, group_size)  # checked in either mode
                if weights == "dequantized":
                    w, scales, biases = node["weight"], node["scales"], node["biases"]
                    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
                    dense = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
                    rest = {k: v for k, v in node.items() if k not in ("weight", "scales", "biases")}
                    return {"weight": dense, **{k: expand(v) for k, v in rest.items()}}
            return {k: expand(v) for k, v in node.items()}
        if isinstance(node, list):
            return [expand(v) for v in node]
        return node

    def cast(leaf: mx.array):
        return leaf.astype(dtype) if mx.issubdtype(leaf.dtype, mx.floating) else leaf

    return tree_map(cast, expand(params))


def load_model(
    path: str | Path,
    name: str,
    dtype: mx.Dtype,
    weights: WeightsMode = "quantized",
    fuse: bool = False,
    impl: ModelImpl = "auto",
) -> LoadedModel:
    """Read a GGUF file or a model directory and prepare it for serving.

    Args:
        path: a Llama-family GGUF file, or a Hugging Face / mlx-community directory.
        name: the model's public name.
        dtype: compute dtype (``mx.float32`` on the CPU, ``mx.float16`` on a GPU).
        weights: keep quantized weights ("quantized") or expand them ("dequantized").
        fuse: concatenate Q/K/V and gate/up projections (:func:`models.llama.fuse_projections`;
            hand-written architectures only).
        impl: which implementation serves the model (:data:`models.architectures.ModelImpl`):
            through mlx-lm's class (:func:`models.lm_loader.load_lm_dir`, or
            :func:`models.lm_loader.load_lm_gguf` for a GGUF file), the model's args are
            :class:`models.adapter.AdapterArgs` and its params the module's ``parameters()``.

    Raises:
        ModelLoadError: the file is missing, unreadable or unsupported (the message names it).
    """
    start = time.perf_counter()
    path = Path(path)
    if uses_mlx_lm(path, impl):
        from models.lm_loader import load_lm_dir, load_lm_gguf  # imports mlx-lm: only for its models

        adapter, module, tok = (
            load_lm_dir(path, dtype, weights) if path.is_dir() else load_lm_gguf(path, dtype, weights)
        )
        params = cast(Params, module.parameters())
        return LoadedModel(name, path, adapter, params, tok, dtype, weights, time.perf_counter() - start)
    args, params, tokenizer = load_dir(path) if path.is_dir() else load_gguf(path)
    params = served_params(params, path, args.quant_group_size, dtype, weights, fuse)
    read_params(params, path)
    return LoadedModel(name, path, args, params, tokenizer, dtype, weights, time.perf_counter() - start)


def served_params(
    params: Params, path: Path, group_size: int, dtype: mx.Dtype, weights: WeightsMode, fuse: bool
) -> Params:
    """Loaded parameters as served, still lazy: converted (:func:`prepare_params`) and fused
    when asked (:func:`models.llama.fuse_projections`). The caller rebinds its name to the
    result before :func:`read_params`, so the file's tensors are freed as they are converted.

    Raises:
        ModelLoadError: naming ``path``, when a tensor cannot be converted.
    """
    try:
        params = prepare_params(params, dtype, weights, group_size)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    return fuse_projections(params) if fuse else params


def read_params(params: Params, path: Path) -> None:
    """Evaluate ``params`` now, so that the file's bytes are read at load time.

    Raises:
        ModelLoadError: naming ``path``, when the file is truncated or corrupt (the read fails here).
    """
    try:
        mx.eval(params)
    except Exception as exc:  # a truncated file fails here, when the bytes are read
        raise ModelLoadError(f"model file {path} could not be read ({exc}); the file is truncated or corrupt") from exc
