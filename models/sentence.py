"""Embedding models in sentence-transformers' directory layout: found, loaded and described.

A sentence-transformers directory (e.g. all-MiniLM-L6-v2) holds the encoder as a transformers
checkpoint (``config.json``, ``model.safetensors``, ``tokenizer.json``) plus ``modules.json``,
the pipeline applied after it: ``sentence_transformers.models.Pooling`` (its options in
``<path>/config.json``, e.g. ``1_Pooling/config.json``) and optionally ``Normalize``;
``sentence_bert_config.json`` gives ``max_seq_length``, the longest input in tokens.

Finding such a directory, and the packaged test model, without MLX: :mod:`models.embedding_dir`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from tokenizers import Tokenizer

from models import bert
from models.errors import ModelLoadError

_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass
class EmbeddingModel:
    """An encoder ready to embed.

    Attributes:
        name: the name clients send as ``model``.
        path: the directory it came from.
        args: the encoder's hyper-parameters.
        params: its parameter tree in ``dtype``.
        tokenizer: ``tokenizer.json`` with truncation and padding off (the engine pads).
        pooling: "mean" or "cls".
        normalize: whether embeddings are scaled to unit L2 norm.
        max_tokens: the longest input in tokens (``max_seq_length``, else the position table).
        dtype: compute dtype.
        load_seconds: wall time to read the weights.
    """

    name: str
    path: Path
    args: bert.BertArgs
    params: bert.Params
    tokenizer: Tokenizer
    pooling: str
    normalize: bool
    max_tokens: int
    dtype: mx.Dtype
    load_seconds: float

    @property
    def dimensions(self) -> int:
        """Length of one embedding."""
        return self.args.hidden_size

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters in memory (``dtype``; the pooler head is not loaded)."""
        return sum(v.nbytes for _, v in tree_flatten(self.params) if isinstance(v, mx.array))

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text with the model's special tokens ([CLS] ... [SEP]), untruncated."""
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def embed(self, ids: mx.array, mask: mx.array) -> mx.array:
        """Embeddings of a padded batch. ids, mask: [B, T] int32 (mask 1 for real tokens, each
        row at least one). Returns [B, H] float32, pooled (and normalized) as the model says."""
        hidden = bert.encode(self.args, self.params, ids, mask)
        pooled = bert.mean_pool(hidden, mask) if self.pooling == "mean" else bert.cls_pool(hidden, mask)
        return bert.l2_normalize(pooled) if self.normalize else pooled


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read it ({exc})") from exc


def _pipeline(path: Path) -> tuple[str, bool]:
    """(pooling, normalize) from ``modules.json`` and the Pooling module's config; a plain
    transformers directory (no ``modules.json``) is mean-pooled and not normalized."""
    if not (path / "modules.json").is_file():
        return "mean", False
    pooling, normalize = None, False
    for module in json.loads((path / "modules.json").read_text()):
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Pooling":
            config = _read_json(path / module["path"] / "config.json")
            modes = [mode for key, mode in _POOLING.items() if config.get(key)]
            others = [k for k, v in config.items() if k.startswith("pooling_mode") and v and k not in _POOLING]
            if len(modes) != 1 or others:
                raise ModelLoadError(
                    f"{path / module['path']}: pooling {sorted(k for k, v in config.items() if v is True)} is not "
                    "implemented; only one of mean tokens or CLS token"
                )
            pooling = modes[0]
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ModelLoadError(f"{path / 'modules.json'}: module {module.get('type')} is not implemented")
    if pooling is None:
        raise ModelLoadError(f"{path / 'modules.json'}: no Pooling module")
    return pooling, normalize


def load_embedding_model(path: Path, name: str, dtype: mx.Dtype) -> EmbeddingModel:
    """Load a BERT embedding model directory (see the module docstring).

    Raises:
        ModelLoadError: a file is missing or unreadable, the model type is not ``bert``, or
            its pooling is not implemented; the message names the file.
    """
    start = time.perf_counter()
    config = _read_json(path / "config.json")
    if config.get("model_type") != "bert":
        raise ModelLoadError(
            f"{path / 'config.json'}: model_type '{config.get('model_type')}' is not implemented for embeddings; "
            "only 'bert' (e.g. all-MiniLM-L6-v2)"
        )
    args = bert.BertArgs.from_dict(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))  # type: ignore[arg-type]
    flat = [(k, v.astype(dtype)) for k, v in bert.sanitize(weights).items()]
    params = tree_unflatten(flat)
    mx.eval(params)
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path}: no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_truncation()  # longer inputs are refused, never cut short silently
    tokenizer.no_padding()
    st_config = path / "sentence_bert_config.json"
    max_tokens = _read_json(st_config).get("max_seq_length") if st_config.is_file() else None
    max_tokens = min(max_tokens or args.max_position_embeddings, args.max_position_embeddings)
    pooling, normalize = _pipeline(path)
    return EmbeddingModel(
        name, path, args, params, tokenizer, pooling, normalize, max_tokens, dtype, time.perf_counter() - start
    )
