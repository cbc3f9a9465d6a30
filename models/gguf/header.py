"""Check a GGUF file's header and metadata layout before MLX parses it.

MLX's GGUF reader (gguflib) trusts the lengths and counts it reads: a file whose metadata
is damaged (a string length or a tensor count of random bytes) makes it read past the
mapping and the process dies with a segmentation fault, without a word about the file.
This walks the same layout in Python with every length checked against the file size, so
such a file fails with a :class:`GGUFLayoutError` naming the first bad field, which
:func:`models.gguf.reader.read_gguf` reports with the file's name. Tensor data is not read:
MLX itself reports tensors that extend past the end of the file.

:func:`read_gguf_header` walks the same layout and also returns the metadata values and the
tensor infos, for files whose tensor types MLX's reader cannot load (it fails the whole file;
:mod:`models.gguf.quants` then reads them with llama.cpp's ``gguf`` package).

Layout (ggml/docs/gguf.md, versions 2 and 3, little-endian): magic ``GGUF``, version u32,
tensor count u64, metadata count u64; each metadata entry is a string key, a value type
u32 and a value; each tensor info is a string name, n_dims u32, n_dims u64 dims, a ggml
type u32 and a data offset u64. A string is a u64 byte length and the bytes. Tensor data
starts at the next multiple of ``general.alignment`` (default 32) after the tensor infos.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes
#: GGUF metadata value type -> numpy dtype (gguf.md: uint8 ... float64; 7 is bool).
VALUE_DTYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_GGML_TYPE = 64  # ggml types are numbered well below this
_MAX_ELEMENTS = 1 << 40  # per tensor; keeps dimension products far from overflowing


class GGUFLayoutError(ValueError):
    """A GGUF file that is not GGUF, of an unsupported version, or damaged; the message
    names the first bad field and its byte offset."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: its name, shape in GGUF order (ne0 first: [in, out] for a
    weight), ggml type number and byte offset from the start of the data section."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass
class GGUFHeader:
    """A GGUF file's metadata (scalars as Python values, arrays as lists), its tensor
    infos in file order, and the byte offset where tensor data starts."""

    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    data_offset: int = 0


class _Reader:
    def __init__(self, data, keep: bool = False):
        self.data, self.at, self.keep = data, 0, keep

    def fail(self, what: str) -> GGUFLayoutError:
        return GGUFLayoutError(f"{what} at byte {self.at} (file size {len(self.data)} bytes)")

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.at + n > len(self.data):
            raise self.fail(f"{what} of {n} bytes runs past the end of the file")
        start, self.at = self.at, self.at + n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.data, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.data, self.take(8, what))[0]

    def string(self, what: str) -> str | None:
        n = self.u64(f"{what} length")
        start = self.take(n, what)
        return bytes(self.data[start : start + n]).decode("utf-8", errors="replace") if self.keep else None

    def scalars(self, kind: int, count: int, what: str) -> Any:
        start = self.take(count * _SCALARS[kind], what)
        if not self.keep:
            return None
        values = np.frombuffer(self.data, VALUE_DTYPES[kind], count, start)
        return values.astype(bool) if kind == 7 else values

    def value(self, kind: int, what: str) -> Any:
        if kind in _SCALARS:
            values = self.scalars(kind, 1, what)
            return None if values is None else values[0].item()
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            raise self.fail(f"{what} has unknown value type {kind}")
        item, count = self.u32(f"{what} item type"), self.u64(f"{what} length")
        if item == _ARRAY:
            raise self.fail(f"{what} is an array of arrays")
        if item in _SCALARS:
            values = self.scalars(item, count, what)
            return None if values is None else values.tolist()
        if item != _STRING:
            raise self.fail(f"{what} has unknown item type {item}")
        if count * 8 > len(self.data) - self.at:
            raise self.fail(f"{what} claims {count} strings")
        return [self.string(what) for _ in range(count)]


def check_gguf_layout(path: str | Path) -> GGUFHeader:
    """Walk the header, metadata and tensor infos of a GGUF file, checking every length.
    Returns the tensor infos (the metadata values are not kept: :func:`read_gguf_header`).

    Raises:
        GGUFLayoutError: the file is empty or not GGUF, of an unsupported version, or its
            header or metadata is damaged; the message names the first bad field.
    """
    return _walk(Path(path), keep=False)


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """:func:`check_gguf_layout`, returning what it walked: metadata values, tensor infos and
    the data offset.

    Raises:
        GGUFLayoutError: as :func:`check_gguf_layout`, or a tensor that starts past the end
            of the file.
    """
    return _walk(Path(path), keep=True)


def _walk(path: Path, keep: bool) -> GGUFHeader:
    header = GGUFHeader()
    with path.open("rb") as f:
        if path.stat().st_size == 0:
            raise GGUFLayoutError("the file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            r = _Reader(data, keep)
            if data[:4] != b"GGUF":
                raise GGUFLayoutError("it does not start with 'GGUF', so it is not a GGUF file")
            r.take(4, "magic")
            version = r.u32("version")
            if version not in (2, 3):
                raise r.fail(f"GGUF version {version} (supported: 2, 3)")
            tensors, entries = r.u64("tensor count"), r.u64("metadata count")
            # The smallest metadata entry and tensor info take 13 and 28 bytes.
            if entries * 13 + tensors * 28 > len(data):
                raise r.fail(f"the header claims {tensors} tensors and {entries} metadata entries")
            for i in range(entries):
                key = r.string(f"metadata key {i}")
                value = r.value(r.u32(f"metadata {i} value type"), f"metadata {i} value")
                if keep:
                    header.metadata[str(key)] = value
            for i in range(tensors):
                header.tensors.append(_tensor_info(r, i))
            alignment = int(header.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)) or _DEFAULT_ALIGNMENT
            header.data_offset = -(-r.at // alignment) * alignment
            bad = [t.name for t in header.tensors if keep and header.data_offset + t.offset > len(data)]
            if bad:
                raise GGUFLayoutError(f"tensor {bad[0]} starts past the end of the file (size {len(data)} bytes)")
    return header


def _tensor_info(r: _Reader, i: int) -> TensorInfo:
    name = r.string(f"tensor {i} name")
    n_dims = r.u32(f"tensor {i} n_dims")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise r.fail(f"tensor {i} has {n_dims} dimensions")
    dims = tuple(r.u64(f"tensor {i} dimension") for _ in range(n_dims))
    elements = 1
    for d in dims:
        elements *= d
    if not 0 < elements <= _MAX_ELEMENTS:
        raise r.fail(f"tensor {i} has {elements} elements")
    ggml_type = r.u32(f"tensor {i} type")
    if ggml_type >= _MAX_GGML_TYPE:
        raise r.fail(f"tensor {i} has an unknown ggml type")
    return TensorInfo(name or "", dims, ggml_type, r.u64(f"tensor {i} offset"))
