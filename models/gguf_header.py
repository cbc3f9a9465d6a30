"""Check a GGUF file's header and metadata layout before MLX parses it.

MLX's GGUF reader (gguflib) trusts the lengths and counts it reads: a file whose metadata
is damaged (a string length or a tensor count of random bytes) makes it read past the
mapping and the process dies with a segmentation fault, without a word about the file.
This walks the same layout in Python with every length checked against the file size, so
such a file fails with a :class:`GGUFLayoutError` naming the first bad field, which
:func:`models.gguf.read_gguf` reports with the file's name. Tensor data is not read:
MLX itself reports tensors that extend past the end of the file.

Layout (ggml/docs/gguf.md, versions 2 and 3, little-endian): magic ``GGUF``, version u32,
tensor count u64, metadata count u64; each metadata entry is a string key, a value type
u32 and a value; each tensor info is a string name, n_dims u32, n_dims u64 dims, a ggml
type u32 and a data offset u64. A string is a u64 byte length and the bytes.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_GGML_TYPE = 64  # ggml types are numbered well below this
_MAX_ELEMENTS = 1 << 40  # per tensor; keeps dimension products far from overflowing


class GGUFLayoutError(ValueError):
    """A GGUF file that is not GGUF, of an unsupported version, or damaged; the message
    names the first bad field and its byte offset."""


class _Reader:
    def __init__(self, data):
        self.data, self.at = data, 0

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

    def string(self, what: str) -> None:
        self.take(self.u64(f"{what} length"), what)

    def value(self, kind: int, what: str) -> None:
        if kind in _SCALARS:
            self.take(_SCALARS[kind], what)
        elif kind == _STRING:
            self.string(what)
        elif kind == _ARRAY:
            item, count = self.u32(f"{what} item type"), self.u64(f"{what} length")
            if item == _ARRAY:
                raise self.fail(f"{what} is an array of arrays")
            if item in _SCALARS:
                self.take(count * _SCALARS[item], what)
            elif item == _STRING:
                if count * 8 > len(self.data) - self.at:
                    raise self.fail(f"{what} claims {count} strings")
                for _ in range(count):
                    self.string(what)
            else:
                raise self.fail(f"{what} has unknown item type {item}")
        else:
            raise self.fail(f"{what} has unknown value type {kind}")


def check_gguf_layout(path: str | Path) -> None:
    """Walk the header, metadata and tensor infos of a GGUF file, checking every length.

    Raises:
        GGUFLayoutError: the file is empty or not GGUF, of an unsupported version, or its
            header or metadata is damaged; the message names the first bad field.
    """
    path = Path(path)
    with path.open("rb") as f:
        if path.stat().st_size == 0:
            raise GGUFLayoutError("the file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            r = _Reader(data)
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
                r.string(f"metadata key {i}")
                r.value(r.u32(f"metadata {i} value type"), f"metadata {i} value")
            for i in range(tensors):
                r.string(f"tensor {i} name")
                n_dims = r.u32(f"tensor {i} n_dims")
                if not 1 <= n_dims <= _MAX_DIMS:
                    raise r.fail(f"tensor {i} has {n_dims} dimensions")
                elements = 1
                for _ in range(n_dims):
                    elements *= r.u64(f"tensor {i} dimension")
                if not 0 < elements <= _MAX_ELEMENTS:
                    raise r.fail(f"tensor {i} has {elements} elements")
                if r.u32(f"tensor {i} type") >= _MAX_GGML_TYPE:
                    raise r.fail(f"tensor {i} has an unknown ggml type")
                r.u64(f"tensor {i} offset")
