"""A GGUF file read through a memory map: its scalar metadata and its tensors' bytes.

Metadata arrays (the tokenizer's strings) are skipped, not decoded. `raw(tensor)` is a view
of the map, never a copy; `release(view)` drops its pages from the resident set once read.
The file is untrusted: every count, length, dimension and offset is checked against the
file's bytes and llama.cpp's rules (aligned tensors, in order, never overlapping) before
anything is read or allocated, else a `GGUFError` names the file and the field; every
other reader of a user's GGUF file in services/ runs only on a file this one accepted.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.model_errors import ModelLoadError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME (64) less its terminator: llama.cpp refuses longer names
MAX_KEY_BYTES = 65535  # the GGUF specification's bound on a key
# An array of arrays of values at most. llama.cpp reads no nested arrays at all; gguf's
# writer can write them, so one level of nesting still loads.
MAX_ARRAY_DEPTH = 2
# Bounds on what a file may make a reader build, one Python object (or, in gguf's
# GGUFReader, which transformers reads the tokenizer with, two numpy views) per item, so
# a file at every bound still opens in about a second. Real files hold under a hundred
# keys, at most a couple of thousand tensors (experts are stacked), and about half a
# million strings (Llama 3: 128k tokens and 280k merges).
MAX_METADATA_KEYS = 1 << 16
MAX_TENSORS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 22  # strings and arrays inside metadata arrays, in the whole file
INT64_MAX = (1 << 63) - 1

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
    39: ("MXFP4", 32, 17),
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
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_STRUCTS: dict[str, struct.Struct] = {}
# The fewest bytes a metadata entry (an empty key, a uint8 value), a tensor's entry in the
# table (an empty name, one dimension, type, offset), a string (its length) and an array
# (element type and count) take: what a count is checked against before the loop it drives.
_MIN_ENTRY_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
_MIN_ITEM_BYTES = {_STRING: 8, _ARRAY: 4 + 8}


class GGUFError(ModelLoadError):
    """A file that cannot be read as GGUF; the message names the file and the field."""


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


@dataclass(frozen=True)
class _TensorInfo:
    """A tensor's entry in the table, checked on its own (its place is checked after)."""

    name: str
    ne: tuple[int, ...]  # ggml order: innermost first
    type_name: str
    offset: int  # in the data section
    nbytes: int
    row_bytes: int


def _aligned(position: int, alignment: int) -> int:
    return -(-position // alignment) * alignment


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
        self._size = len(self._map)
        self._pos = 0
        self._items = 0  # strings and arrays inside arrays so far (MAX_ARRAY_ITEMS)
        self.version, self.metadata, self.tensors = self._parse()

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes, uint8 [rows, row_bytes], a read-only view of the map."""
        flat = self._bytes[tensor.offset : tensor.offset + tensor.nbytes]
        return flat.reshape(tensor.rows, tensor.row_bytes)

    def release(self, view: np.ndarray) -> None:
        """The map's pages under `view` (of `raw`'s bytes) leave this process's resident
        set: read once, a tensor need not stay in memory beside what it was decoded into.
        The map stays valid (a later read faults the pages in again from the page cache);
        bytes that are not the map's are left alone."""
        if view.size == 0 or not hasattr(self._map, "madvise"):
            return
        start = view.__array_interface__["data"][0] - self._bytes.__array_interface__["data"][0]
        span = 1 + sum((n - 1) * stride for n, stride in zip(view.shape, view.strides, strict=True))
        if start < 0 or start + span > self._size:
            return
        first = start - start % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, first, start + span - first)

    # -- reading, every read bounded by the file ------------------------------------------

    def _error(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {problem}")

    def _left(self) -> int:
        return self._size - self._pos

    def _take(self, size: int, field: str) -> int:
        """Consume `size` bytes; their first position. The file must hold them."""
        start = self._pos
        if size > self._size - start:
            raise self._error(
                f"the file ends inside its header or metadata (truncated?): {field} needs "
                f"{size} bytes at offset {start}, {self._size - start} are left"
            )
        self._pos = start + size
        return start

    def _read(self, fmt: str, field: str) -> tuple:
        layout = _STRUCTS.get(fmt) or _STRUCTS.setdefault(fmt, struct.Struct("<" + fmt))
        return layout.unpack_from(self._map, self._take(layout.size, field))

    def _string(self, field: str, limit: int | None = None) -> str:
        (length,) = self._read("Q", field)
        if limit is not None and length > limit:
            raise self._error(f"{field} is {length} bytes long; GGUF allows at most {limit}")
        start = self._take(length, field)
        return self._map[start : start + length].decode("utf-8", errors="replace")

    def _check_count(self, count: int, what: str, item_bytes: int, limit: int | None = None):
        """A count the file states, against its bound and what the bytes left could hold
        (each item takes at least `item_bytes`), before anything loops over it."""
        if limit is not None and count > limit:
            raise self._error(f"the file declares {count} {what}; at most {limit} load")
        if count * item_bytes > self._left():
            raise self._error(
                f"the file ends inside its header or metadata (truncated?): it declares "
                f"{count} {what}, but the {self._left()} bytes left hold at most "
                f"{self._left() // item_bytes}"
            )

    # -- metadata ---------------------------------------------------------------------------

    def _metadata(self, count: int) -> dict[str, object]:
        metadata: dict[str, object] = {}
        for index in range(count):
            key = self._string(f"metadata key #{index}", MAX_KEY_BYTES)
            if key in metadata:
                raise self._error(f"metadata key {key!r} appears twice")
            (kind,) = self._read("I", f"the type of metadata {key!r}")
            metadata[key] = self._value(kind, f"metadata {key!r}", depth=0)
            if key == ALIGNMENT_KEY:
                self._check_alignment(kind, metadata[key])
        return metadata

    def _value(self, kind: int, field: str, depth: int) -> object:
        """One value of type `kind`; `depth` arrays enclose it."""
        if kind in _SCALARS:
            return self._read(_SCALARS[kind], field)[0]
        if kind == _STRING:
            return self._string(field)
        if kind == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self._error(
                    f"{field} nests arrays {depth + 1} deep; at most {MAX_ARRAY_DEPTH} load"
                )
            element, count = self._read("IQ", field)
            self._skip_array(element, count, field, depth + 1)
            return MetadataArray(element, count)
        raise self._error(f"{field} has unknown value type {kind}")

    def _skip_array(self, element: int, count: int, field: str, depth: int) -> None:
        """Step over an array's values, checking each against the file (`depth`: the arrays
        enclosing them, this one included)."""
        if element in _SCALARS:
            self._take(struct.calcsize("<" + _SCALARS[element]) * count, field)
            return
        if element not in _MIN_ITEM_BYTES:
            raise self._error(f"{field} is an array of unknown value type {element}")
        self._items += count
        if self._items > MAX_ARRAY_ITEMS:
            raise self._error(
                f"{field} brings the strings and arrays inside the file's metadata arrays "
                f"to {self._items}; at most {MAX_ARRAY_ITEMS} load"
            )
        self._check_count(count, f"values in {field}", _MIN_ITEM_BYTES[element])
        if element == _STRING:
            self._skip_strings(count, field)
        else:
            for _ in range(count):
                self._value(_ARRAY, field, depth)

    def _skip_strings(self, count: int, field: str) -> None:
        """Step over `count` strings: the hot loop of a vocabulary, one unpack each."""
        unpack, pos = _STRUCTS.setdefault("Q", struct.Struct("<Q")).unpack_from, self._pos
        try:
            for _ in range(count):
                pos += 8 + unpack(self._map, pos)[0]
        except (struct.error, OverflowError):  # a length field past the end of the file
            pos = self._size + 1
        if pos > self._size:
            raise self._error(
                f"the file ends inside its header or metadata (truncated?): the {count} "
                f"strings of {field} run past its {self._size} bytes"
            )
        self._pos = pos

    def _check_alignment(self, kind: int, value: object) -> None:
        if kind != _UINT32:
            raise self._error(
                f"metadata {ALIGNMENT_KEY!r} has value type {kind}; GGUF stores it as uint32 (4)"
            )
        if value == 0 or value & (value - 1):
            raise self._error(
                f"metadata {ALIGNMENT_KEY!r} is {value}; it must be a non-zero power of two"
            )

    # -- the tensor table ---------------------------------------------------------------------

    def _tensor_info(self, index: int, seen: set[str]) -> _TensorInfo:
        name = self._string(f"the name of tensor #{index}", MAX_NAME_BYTES)
        field = f"tensor {name!r}"
        if name in seen:
            raise self._error(f"{field} appears twice")
        seen.add(name)
        (n_dims,) = self._read("I", f"the dimension count of {field}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self._error(
                f"{field} has {n_dims} dimensions; GGUF allows 1 to at most {MAX_DIMS}"
            )
        ne = self._read("Q" * n_dims, f"the dimensions of {field}")
        kind, offset = self._read("IQ", f"the type and offset of {field}")
        return self._checked_info(field, name, ne, kind, offset)

    def _checked_info(
        self, field: str, name: str, ne: tuple[int, ...], kind: int, offset: int
    ) -> _TensorInfo:
        """The entry's size from its dimensions and type, each product checked."""
        elements = 1
        for dim in ne:
            if dim == 0:
                raise self._error(f"{field} has a zero dimension in {list(ne)}")
            elements *= dim
            if elements > INT64_MAX:
                raise self._error(
                    f"{field} with dimensions {list(ne)} has more than 2^63 - 1 elements"
                )
        if kind not in GGML_TYPES:
            raise self._error(f"{field} has unknown tensor type {kind}")
        type_name, block, block_bytes = GGML_TYPES[kind]
        if ne[0] % block:
            raise self._error(
                f"{field} ({type_name}) has rows of {ne[0]} elements, not whole blocks of {block}"
            )
        row_bytes = ne[0] // block * block_bytes
        nbytes = elements // block * block_bytes
        if nbytes > self._size:
            raise self._error(f"{field} needs {nbytes} bytes; the whole file has {self._size}")
        return _TensorInfo(name, ne, type_name, offset, nbytes, row_bytes)

    def _place(self, infos: list[_TensorInfo], alignment: int) -> list[GGUFTensor]:
        """The tensors in the file. Each one's data starts where the previous one's ends,
        padded to the alignment (llama.cpp's rule), so no two overlap, all are aligned and
        in order; the data must end inside the file."""
        data_start, expected = _aligned(self._pos, alignment), 0
        tensors = []
        for info in infos:
            if info.offset != expected:
                raise self._error(self._misplaced(info, expected, alignment))
            begin = data_start + info.offset
            if begin + info.nbytes > self._size:
                raise GGUFError(
                    f"{self.path} is truncated: tensor {info.name!r} needs bytes "
                    f"[{begin}, {begin + info.nbytes}) but the file has {self._size}"
                )
            shape = tuple(reversed(info.ne))
            tensors.append(
                GGUFTensor(info.name, info.type_name, shape, begin, info.nbytes, info.row_bytes)
            )
            expected = _aligned(info.offset + info.nbytes, alignment)
        return tensors

    @staticmethod
    def _misplaced(info: _TensorInfo, expected: int, alignment: int) -> str:
        where = f"tensor {info.name!r} starts at data offset {info.offset}"
        if info.offset % alignment:
            return f"{where}, not a multiple of the alignment {alignment}"
        if info.offset < expected:
            return f"{where}, inside the tensor before it (which ends at {expected})"
        return f"{where}; the tensor before it ends at {expected} (GGUF leaves no gaps)"

    # -- the whole file ---------------------------------------------------------------------

    def _parse(self) -> tuple[int, dict[str, object], list[GGUFTensor]]:
        if self._map[:4] != MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (it does not start with 'GGUF')")
        self._pos = len(MAGIC)
        version, n_tensors, n_kv = self._read("IQQ", "the header")
        if version not in (2, 3):
            raise self._error(f"GGUF version {version}; versions 2 and 3 load")
        self._check_count(n_kv, "metadata entries", _MIN_ENTRY_BYTES, MAX_METADATA_KEYS)
        metadata = self._metadata(n_kv)
        self._check_count(n_tensors, "tensors", _MIN_TENSOR_INFO_BYTES, MAX_TENSORS)
        seen: set[str] = set()
        infos = [self._tensor_info(index, seen) for index in range(n_tensors)]
        alignment = int(metadata.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT))
        return version, metadata, self._place(infos, alignment)
