"""A GGUF file read through a memory map: its scalar metadata and its tensors' bytes.

    gguf = GGUFFile(path)
    gguf.architecture                    # "qwen2"
    for tensor in gguf.tensors:          # in file order
        raw = gguf.raw(tensor)           # uint8 [rows, bytes per row], a view of the map

The header, metadata and tensor table are parsed with `struct` straight from the map; array
values (the tokenizer's tokens and merges: hundreds of thousands of strings) are skipped,
not decoded, so opening a file costs milliseconds whatever its vocabulary (gguf's own
GGUFReader builds a numpy view per string: seconds for a 150k vocabulary). A tensor's
bytes are never copied here: `raw` is a view of the map, so the pages are read from the
page cache as the loader consumes them and a tensor-parallel rank touches only the rows it
narrows to. A file that is not GGUF, has an unknown version or is cut short raises
`GGUFError` naming the file and what is wrong.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml type id -> (name, elements per block, bytes per block) (ggml.h; gguf's constants)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
}

# metadata value type -> struct format of a scalar (8: string, 9: array)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A file that cannot be read as GGUF; the message names the file."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # "Q4_K", "F32", ...
    shape: tuple[int, ...]  # torch order: outermost first (ggml's ne reversed)
    offset: int  # of its first byte in the file
    nbytes: int
    row_bytes: int  # bytes of one row (the innermost dimension, ne0)

    @property
    def rows(self) -> int:
        return self.nbytes // self.row_bytes


@dataclass(frozen=True)
class MetadataArray:
    """An array value, left undecoded: its element type and length."""

    element_type: int
    count: int


class GGUFFile:
    """The metadata and tensor table of a GGUF file, and views of its tensors' bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as file:
                self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise GGUFError(f"cannot map GGUF file {self.path}: {exc}") from exc
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._pos = 0
        try:
            self.version, self.metadata, self.tensors = self._parse()
        except struct.error as exc:
            raise GGUFError(
                f"GGUF file {self.path} ends inside its header or metadata (truncated?): {exc}"
            ) from exc

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes, uint8 [rows, row_bytes], a read-only view of the map."""
        flat = self._bytes[tensor.offset : tensor.offset + tensor.nbytes]
        return flat.reshape(tensor.rows, tensor.row_bytes)

    # -- parsing ---------------------------------------------------------------------------

    def _read(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self._map, self._pos)
        self._pos += struct.calcsize("<" + fmt)
        return values

    def _string(self) -> str:
        (length,) = self._read("Q")
        end = self._pos + length
        if end > len(self._map):
            raise struct.error(f"a string of {length} bytes at {self._pos}")
        text = self._map[self._pos : end].decode("utf-8", errors="replace")
        self._pos = end
        return text

    def _value(self, kind: int) -> object:
        if kind in _SCALARS:
            return self._read(_SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            element, count = self._read("IQ")
            self._skip_array(element, count)
            return MetadataArray(element, count)
        raise GGUFError(f"GGUF file {self.path}: unknown metadata value type {kind}")

    def _skip_array(self, element: int, count: int) -> None:
        if element in _SCALARS:
            self._pos += struct.calcsize("<" + _SCALARS[element]) * count
        elif element == _STRING:
            unpack, pos = struct.Struct("<Q").unpack_from, self._pos
            for _ in range(count):
                pos += 8 + unpack(self._map, pos)[0]
            self._pos = pos
        else:  # nested arrays: rare (none in llama.cpp's writers); decoded to skip them
            for _ in range(count):
                self._value(element)
        if self._pos > len(self._map):
            raise struct.error(f"an array of {count} values past the end of the file")

    def _parse(self) -> tuple[int, dict[str, object], list[GGUFTensor]]:
        if self._map[:4] != MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (it does not start with 'GGUF')")
        self._pos = len(MAGIC)
        version, n_tensors, n_kv = self._read("IQQ")
        if version not in (2, 3):
            raise GGUFError(f"GGUF file {self.path} has version {version}; versions 2 and 3 load")
        metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            (kind,) = self._read("I")
            metadata[key] = self._value(kind)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        tensors = [self._tensor(start, *info) for info in infos]
        return version, metadata, tensors

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (n_dims,) = self._read("I")
        dims = self._read("Q" * n_dims)
        kind, offset = self._read("IQ")
        return name, tuple(int(d) for d in dims), kind, offset

    def _tensor(self, start: int, name: str, ne: tuple[int, ...], kind: int, offset: int):
        if kind not in GGML_TYPES:
            raise GGUFError(f"GGUF file {self.path}: tensor {name} has unknown type {kind}")
        type_name, block, size = GGML_TYPES[kind]
        if ne[0] % block:
            raise GGUFError(
                f"GGUF file {self.path}: tensor {name} ({type_name}) has rows of {ne[0]} "
                f"elements, not whole blocks of {block}"
            )
        row_bytes = ne[0] // block * size
        nbytes = row_bytes * int(np.prod(ne[1:], dtype=np.int64))
        begin = start + offset
        if begin + nbytes > len(self._map):
            raise GGUFError(
                f"GGUF file {self.path} is truncated: tensor {name} needs bytes "
                f"[{begin}, {begin + nbytes}) but the file has {len(self._map)}"
            )
        return GGUFTensor(name, type_name, tuple(reversed(ne)), begin, nbytes, row_bytes)
