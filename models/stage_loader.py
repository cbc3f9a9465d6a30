"""Load one pipeline stage's weights, and only those, from a GGUF file or a model directory.

Every rank of a pipeline group reads the same file (a copy on each host) but keeps only its
stage's tensors (:func:`models.pipeline.stage_params`):

* **model directories** (``*.safetensors``): ``mx.load`` of a safetensors file is lazy (an
  array's bytes are read when it is first evaluated), so the whole tree is built lazily and
  only the stage's arrays are ever evaluated;
* **GGUF**: ``mx.load`` copies every tensor at once, so the header is parsed here and only the
  stage's tensors are read (:mod:`models.gguf.tensors`); the rest of the tree is unevaluated
  placeholders that give the shapes and are dropped.

The split itself needs only shapes: :func:`model_layout` prepares the whole tree lazily (the
serving dtype, dequantized or not) and counts each layer's bytes without reading a weight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from models.errors import ModelLoadError
from models.gguf.header import GGUFLayoutError
from models.gguf.reader import args_from_metadata, params_from_tensors
from models.gguf.tensors import GGUFTensorError, placeholders, read_index, read_tensors
from models.gguf.vocab import tokenizer_from_gguf
from models.hf import load_dir
from models.layers import Params
from models.loader import WeightsMode, prepare_params, read_params, served_params
from models.model_args import ModelArgs
from models.pipeline import Stage, plan_stages, stage_params
from models.tokenizer import ChatTokenizer


@dataclass
class StageModel:
    """One stage ready for the stage step functions (:mod:`models.pipeline`).

    Attributes:
        path: the file or directory it came from.
        args: the whole model's hyper-parameters.
        stage: which layers (and ends) it holds.
        params: the stage's parameter tree in the compute dtype (its layers only).
        tokenizer: the tokenizer on rank 0 (which tokenizes and detokenizes); None elsewhere.
        dtype: compute dtype.
        weights: "quantized" or "dequantized".
        load_seconds: wall time to read and prepare the stage.
    """

    path: Path
    args: ModelArgs
    stage: Stage
    params: Params
    tokenizer: ChatTokenizer | None
    dtype: mx.Dtype
    weights: WeightsMode
    load_seconds: float

    @property
    def nbytes(self) -> int:
        """Bytes of the stage's parameters."""
        return _nbytes(self.params)


@dataclass(frozen=True)
class ModelLayout:
    """What the split needs, in bytes as served (dtype, dequantized or not).

    Attributes:
        args: hyper-parameters.
        layer_bytes: each layer's parameters.
        embed_bytes: the embedding table.
        head_bytes: the final norm and, when untied, ``lm_head``.
    """

    args: ModelArgs
    layer_bytes: list[int]
    embed_bytes: int
    head_bytes: int

    def split(self, size: int, capacities: list[float] | None = None) -> list[Stage]:
        """:func:`models.pipeline.plan_stages` for this model over ``size`` ranks."""
        return plan_stages(
            self.layer_bytes,
            self.embed_bytes,
            self.head_bytes,
            size,
            tied=self.args.tie_word_embeddings,
            capacities=capacities,
        )


def _nbytes(tree: Params) -> int:
    return sum(leaf.nbytes for _, leaf in tree_flatten(tree) if isinstance(leaf, mx.array))


def _gguf_tree(path: Path, wanted: Stage | None) -> tuple[ModelArgs, Params, dict]:
    """(args, the whole tree with the ``wanted`` stage's tensors read and placeholders
    elsewhere, the metadata). ``wanted=None`` reads no tensor."""
    try:
        metadata, infos = read_index(path)
        tensors = placeholders(infos.values())
        args = args_from_metadata(metadata, tensors, path)
        if wanted is not None:
            tensors.update(read_tensors(path, [i for name, i in infos.items() if _in_stage(name, wanted)]))
    except (GGUFLayoutError, GGUFTensorError, OSError) as exc:
        raise ModelLoadError(f"model file {path} could not be read for a pipeline stage: {exc}") from exc
    return args, params_from_tensors(tensors, args, path), metadata


def _in_stage(name: str, stage: Stage) -> bool:
    """Whether GGUF tensor ``name`` belongs to ``stage`` (``blk.N.*`` layers, ``token_embd``,
    ``output_norm`` and ``output``: the names :func:`models.gguf.reader.params_from_tensors` maps)."""
    if name.startswith("blk."):
        return stage.start <= int(name.split(".")[1]) < stage.stop
    if name.startswith("token_embd."):
        return stage.holds_embedding
    return stage.last and name.startswith(("output_norm.", "output."))


def _whole_tree(path: Path, wanted: Stage | None) -> tuple[ModelArgs, Params, ChatTokenizer | None]:
    """(args, the whole parameter tree, unread but for ``wanted``'s tensors, the tokenizer
    when ``wanted`` is the last stage)."""
    if path.is_dir():
        args, params, tokenizer = load_dir(path)  # lazy: nothing read until evaluated
        return args, params, tokenizer if wanted is not None and wanted.last else None
    if not path.is_file():
        raise ModelLoadError(f"model file {path} does not exist; pass a GGUF file or a model directory")
    args, params, metadata = _gguf_tree(path, wanted)
    return args, params, tokenizer_from_gguf(metadata, path) if wanted is not None and wanted.last else None


def model_layout(path: str | Path, dtype: mx.Dtype, weights: WeightsMode = "quantized") -> ModelLayout:
    """Each layer's, the embedding's and the head's bytes once prepared for serving, from
    the shapes alone (no weight is read).

    Raises:
        ModelLoadError: the file is missing, unreadable or unsupported (the message names it).
    """
    args, params, _ = _whole_tree(Path(path), None)
    params = prepare_params(params, dtype, weights, args.quant_group_size)  # lazy: shapes only
    head = _nbytes({k: v for k, v in params.items() if k in ("norm", "lm_head")})
    return ModelLayout(args, [_nbytes(layer) for layer in params["layers"]], _nbytes(params["embed_tokens"]), head)


def load_stage(
    path: str | Path, stage: Stage, dtype: mx.Dtype, weights: WeightsMode = "quantized", fuse: bool = False
) -> StageModel:
    """Read and prepare ``stage``'s parameters only (see the module doc for how each format
    avoids the rest).

    Args:
        path: a Llama-family GGUF file, or a Hugging Face / mlx-community directory.
        stage: the stage to load (from :meth:`ModelLayout.split`).
        dtype: compute dtype.
        weights: keep quantized weights ("quantized") or expand them ("dequantized").
        fuse: concatenate Q/K/V and gate/up projections (:func:`models.llama.fuse_projections`).

    Raises:
        ModelLoadError: the file is missing, unreadable or unsupported, or the stage asks for
            layers the model does not have.
    """
    start = time.perf_counter()
    path = Path(path)
    args, params, tokenizer = _whole_tree(path, stage)
    if stage.stop > args.num_hidden_layers:
        raise ModelLoadError(f"{path}: stage {stage} asks for layers beyond its {args.num_hidden_layers}")
    params = served_params(stage_params(params, stage), path, args.quant_group_size, dtype, weights, fuse)
    read_params(params, path)
    return StageModel(path, args, stage, params, tokenizer, dtype, weights, time.perf_counter() - start)
