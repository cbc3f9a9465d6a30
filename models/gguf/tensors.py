"""Read chosen tensors of a GGUF file, and never the rest.

``mx.load`` on a GGUF file copies every tensor into MLX memory before it returns (MLX's
``load_gguf`` in mlx/io/gguf.cpp mallocs and fills each array while parsing; there is no lazy
or key-selecting form), so a pipeline stage that needs 15 of 30 layers would still hold the
whole file for a while. This module parses the header and metadata itself (the layout of
ggml/docs/gguf.md, versions 2 and 3, little-endian, checked first by
:func:`models.gguf.header.check_gguf_layout`), then reads only the byte ranges of the tensors
asked for and converts them exactly as ``mx.load`` does (mlx/io/gguf_quants.cpp):

* F32 and F16 tensors as float32 / float16 arrays;
* Q4_0, Q4_1 and Q8_0 tensors as MLX affine triples (group 32): ``weight`` uint32
  [rows, cols * bits / 32], ``scales`` and ``biases`` float16 [rows, cols / 32], with
  ``w = scale * q + bias`` (Q4_1: the block's ``d`` and ``m``; Q4_0: ``d`` and ``-8 d``;
  Q8_0: ``d`` and ``-128 d`` with ``q`` the int8 value + 128).

Shapes are in MLX order (GGML lists dimensions innermost first). Other tensor types raise.
"""

from __future__ import annotations

import mmap
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from models.gguf.header import VALUE_DTYPES, check_gguf_layout

F32, F16, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 8  # ggml_type numbers (ggml.h)
#: ggml type -> (values per block, bytes per block), for the types read here (ggml-common.h).
BLOCKS = {F32: (1, 4), F16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34)}
GROUP = 32  # values per quantization block: MLX's group size for these tensors
_BOOL, _STRING, _ARRAY = 7, 8, 9


class GGUFTensorError(ValueError):
    """A tensor this reader cannot convert (its type), or a name the file does not hold."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file.

    Attributes:
        name: the GGUF name (``blk.3.attn_q.weight``).
        shape: in MLX order (outermost first), as the values' shape before quantization.
        ggml_type: the ggml type number (F32 0, F16 1, Q4_0 2, Q4_1 3, Q8_0 8, ...).
        offset: absolute byte offset of its data in the file.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def nbytes(self) -> int:
        """Bytes of its data in the file. Raises GGUFTensorError for a type not read here."""
        per_block, block_bytes = self.block()
        return int(np.prod(self.shape)) // per_block * block_bytes

    def block(self) -> tuple[int, int]:
        """(values per block, bytes per block). Raises GGUFTensorError for a type not read here."""
        if self.ggml_type not in BLOCKS:
            raise GGUFTensorError(
                f"tensor {self.name} has ggml type {self.ggml_type}; the stage loader reads F32, F16, Q4_0, Q4_1 "
                "and Q8_0 (convert the model with `stepserve convert` and serve the directory)"
            )
        return BLOCKS[self.ggml_type]


class _Cursor:
    """Reads GGUF values from ``data`` (a mapping of the file) at ``at``, advancing it."""

    def __init__(self, data: mmap.mmap):
        self.data, self.at = data, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.at += n
        return bytes(self.data[self.at - n : self.at]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            dtype = np.dtype(VALUE_DTYPES[item])
            values = np.frombuffer(self.data, dtype, count, self.at)
            self.at += count * dtype.itemsize
            return values.astype(bool).tolist() if item == _BOOL else values.tolist()
        value = np.frombuffer(self.data, VALUE_DTYPES[kind], 1, self.at)[0].item()
        self.at += np.dtype(VALUE_DTYPES[kind]).itemsize
        return bool(value) if kind == _BOOL else value


def read_index(path: str | Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """A GGUF file's metadata and tensor infos, reading the header only (no tensor data).

    Returns:
        (metadata: numbers as Python scalars, strings as ``str``, arrays as lists;
        {name: :class:`TensorInfo`} in file order).

    Raises:
        models.gguf.header.GGUFLayoutError: the file is not GGUF or its header is damaged.
    """
    path = Path(path)
    check_gguf_layout(path)  # every length below is known to lie inside the file
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        c = _Cursor(data)  # pages of the mapping are read as touched: the header's only
        c.at = 8  # magic, version
        tensors, entries = c.unpack("<Q"), c.unpack("<Q")
        metadata = {}
        for _ in range(entries):
            key = c.string()
            metadata[key] = c.value(c.unpack("<I"))
        raw = []
        for _ in range(tensors):
            name, n_dims = c.string(), c.unpack("<I")
            dims = [c.unpack("<Q") for _ in range(n_dims)]
            raw.append((name, tuple(reversed(dims)), c.unpack("<I"), c.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-c.at // alignment) * alignment
    return metadata, {name: TensorInfo(name, shape, kind, start + off) for name, shape, kind, off in raw}


def _quantized(info: TensorInfo, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weight uint32, scales float16, biases float16) from [n_blocks, block_bytes] uint8."""
    rows, cols = info.shape[:-1], info.shape[-1]
    scales = blocks[:, 0:2].copy().view(np.float16)[:, 0]
    if info.ggml_type == Q8_0:
        packed = blocks[:, 2:] ^ np.uint8(0x80)  # int8 q -> uint8 q + 128, 4 per uint32
        biases, bits = scales * np.float16(-128), 8
    else:
        if info.ggml_type == Q4_1:
            biases, quants = blocks[:, 2:4].copy().view(np.float16)[:, 0], blocks[:, 4:]
        else:
            biases, quants = scales * np.float16(-8), blocks[:, 2:]
        values = np.concatenate([quants & 0x0F, quants >> 4], axis=1)  # GGUF: values j and j + 16 share a byte
        packed = values[:, 0::2] | (values[:, 1::2] << 4)  # MLX: value j at bits 4 (j % 8) of word j // 8
        bits = 4
    weight = np.ascontiguousarray(packed).reshape(-1).view(np.uint32).reshape(*rows, cols * bits // 32)
    return weight, scales.reshape(*rows, cols // GROUP), biases.reshape(*rows, cols // GROUP)


def read_tensors(path: str | Path, infos: Iterable[TensorInfo]) -> dict[str, mx.array]:
    """The named tensors as ``mx.load`` returns them, reading only their bytes.

    A quantized ``X.weight`` gives three arrays, ``X.weight``, ``X.scales`` and ``X.biases``.

    Raises:
        GGUFTensorError: a tensor of a type not read here.
        OSError: the file is shorter than a tensor's range (truncated).
    """
    if sys.byteorder != "little":  # GGUF and the packing below are little-endian
        raise GGUFTensorError("the GGUF stage loader needs a little-endian host")
    out: dict[str, mx.array] = {}
    with Path(path).open("rb") as f:
        for info in infos:
            per_block, block_bytes = info.block()
            f.seek(info.offset)
            data = f.read(info.nbytes)
            if len(data) != info.nbytes:
                raise OSError(f"{path}: tensor {info.name} runs past the end of the file (truncated)")
            if per_block == 1:
                dtype = np.float32 if info.ggml_type == F32 else np.float16
                out[info.name] = mx.array(np.frombuffer(data, dtype).reshape(info.shape))
                continue
            weight, scales, biases = _quantized(info, np.frombuffer(data, np.uint8).reshape(-1, block_bytes))
            stem = info.name.removesuffix(".weight")
            out[info.name], out[f"{stem}.scales"], out[f"{stem}.biases"] = map(mx.array, (weight, scales, biases))
    return out


def placeholders(infos: Iterable[TensorInfo]) -> dict[str, mx.array]:
    """Unevaluated zeros of the shapes and dtypes :func:`read_tensors` (and ``mx.load``) would
    give: enough for code that reads shapes (the split by memory, the parameter tree) and never
    evaluated, so they hold no memory."""
    out: dict[str, mx.array] = {}
    for info in infos:
        per_block, _ = info.block()
        if per_block == 1:
            out[info.name] = mx.zeros(info.shape, mx.float32 if info.ggml_type == F32 else mx.float16)
            continue
        bits = 8 if info.ggml_type == Q8_0 else 4
        rows, cols = info.shape[:-1], info.shape[-1]
        stem = info.name.removesuffix(".weight")
        out[info.name] = mx.zeros((*rows, cols * bits // 32), mx.uint32)
        out[f"{stem}.scales"] = mx.zeros((*rows, cols // GROUP), mx.float16)
        out[f"{stem}.biases"] = mx.zeros((*rows, cols // GROUP), mx.float16)
    return out
