"""Tensors MLX's GGUF reader cannot load, read with llama.cpp's own ``gguf`` package.

``mx.load`` reads F32, F16, Q4_0, Q4_1 and Q8_0 tensors and fails the whole file on any other
type (``gguf_tensor_to_f16 failed`` for the K-quants, Q5_0, ...). For such a file the layout is
walked by :func:`models.gguf.header.read_gguf_header` and each tensor's bytes are decoded by
``gguf.quants.dequantize`` (llama.cpp's reference numpy decoders, the ``gguf`` package on
PyPI) into float32. ``gguf`` is an optional dependency: ``pip install 'stepserve[gguf]'``.

How the float32 values are then kept (dense, or re-quantized to MLX's affine format) is the
loader's choice, :func:`models.gguf.reader.params_from_tensors`; docs/ARCHITECTURE.md has the
measured logit difference of each.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import numpy as np

from models.errors import ModelLoadError
from models.gguf.header import GGUFHeader

#: ggml type numbers MLX's reader loads (ggml.h: GGML_TYPE_F32, F16, Q4_0, Q4_1, Q8_0).
MLX_READABLE_TYPES = frozenset({0, 1, 2, 3, 8})
GGUF_INSTALL = "pip install 'stepserve[gguf]' (llama.cpp's gguf package)"


def gguf_package(path: Path) -> ModuleType:
    """The ``gguf`` package. Raises ModelLoadError naming ``path`` and the install command."""
    try:
        import gguf
    except ImportError as exc:
        raise ModelLoadError(
            f"{path} holds tensor types MLX cannot read (K-quants, Q5_0, ...); reading them needs the optional "
            f"gguf package: {GGUF_INSTALL}"
        ) from exc
    return gguf


def type_names(path: Path, header: GGUFHeader) -> dict[str, str]:
    """Each tensor's ggml type name (``Q4_K``, ``F32``, ...)."""
    quant_type = gguf_package(path).GGMLQuantizationType
    return {t.name: quant_type(t.ggml_type).name for t in header.tensors}


def read_tensors(path: Path, header: GGUFHeader) -> dict[str, mx.array]:
    """Every tensor of ``path`` dequantized to float32, shaped as Hugging Face and mlx-lm
    shape them (GGUF's dimensions reversed: a weight is [out, in]).

    Raises:
        ModelLoadError: ``gguf`` is missing, a tensor type is one it does not know, or the
            data is truncated.
    """
    gguf = gguf_package(path)
    out: dict[str, mx.array] = {}
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for info in header.tensors:
            try:
                qtype = gguf.GGMLQuantizationType(info.ggml_type)
                block, size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError) as exc:
                raise ModelLoadError(
                    f"{path}: tensor {info.name} has ggml type {info.ggml_type}, unknown to gguf"
                ) from exc
            rows, row_elements = int(np.prod(info.dims[1:], dtype=np.int64)), info.dims[0]
            row_bytes = row_elements // block * size
            start = header.data_offset + info.offset
            if start + rows * row_bytes > len(data):
                raise ModelLoadError(f"{path}: tensor {info.name} runs past the end of the file; the file is truncated")
            raw = np.frombuffer(data, np.uint8, rows * row_bytes, start).reshape(rows, row_bytes)
            values = gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False)
            out[info.name] = mx.array(values.reshape(tuple(reversed(info.dims))))
            del raw, values  # the mapping closes with the file: no view of it may outlive this loop
    return out
