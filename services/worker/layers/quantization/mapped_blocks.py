"""`MappedBlocks`: a quantized GGUF tensor's blocks as they lie in the file's map, decoded
only when its layer takes its final form, one tensor at a time.

Narrowing rows (tensor-parallel shards, fused tensors split) keeps a view of the map;
narrowing whole blocks of columns, or permuting rows, copies the raw bytes (no larger
than the file's); `decode()` is `decode_gguf` of those bytes, after which the map's pages
are handed back (`release`), so a load never holds the whole file's pages beside the
whole model's decoded copy: only the packed weights, and one tensor's scratch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.layers.quantization.gguf_blocks import (
    check_gguf_rows,
    decode_gguf,
    gguf_block,
)
from services.worker.layers.quantization.quantized_weight import QuantizedWeight


def _keep(raw: np.ndarray) -> None:
    """The release of bytes that are not the map's (a copy): nothing to hand back."""


@dataclass(frozen=True, eq=False)  # eq=False: a generated __eq__ would compare arrays
class MappedBlocks:
    """A GGUF tensor [N, k] of `type_name` blocks; raw is uint8 [N, row bytes]."""

    raw: np.ndarray
    type_name: str
    k: int
    release: Callable[[np.ndarray], None] = _keep  # hands the map's pages of raw back

    def __post_init__(self) -> None:
        check_gguf_rows(self.raw, self.type_name, self.k)

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.k

    @property
    def source(self) -> str:
        return self.type_name

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def decode(self) -> QuantizedWeight:
        """The weight decoded (fresh tensors); the map's pages of these rows handed back."""
        weight = decode_gguf(self.raw, self.type_name, self.k)
        self.release(self.raw)
        return weight

    def narrow_rows(self, start: int, size: int) -> MappedBlocks:
        """Output features start..start + size (a view of the same bytes)."""
        if start < 0 or size < 0 or start + size > self.shape[0]:
            raise ValueError(f"row range [{start}, {start + size}) is outside 0..{self.shape[0]}")
        return MappedBlocks(self.raw[start : start + size], self.type_name, self.k, self.release)

    def narrow_cols(self, start: int, size: int) -> MappedBlocks | QuantizedWeight:
        """Input features start..start + size: whole blocks as a copy of their bytes, any
        other range decoded and narrowed (QuantizedWeight.narrow_cols's rules)."""
        if start == 0 and size == self.k:
            return self
        block, block_bytes = gguf_block(self.type_name)
        if start % block or size % block or size <= 0 or start + size > self.k:
            return self.decode().narrow_cols(start, size)
        first = start // block * block_bytes
        cols = np.ascontiguousarray(self.raw[:, first : first + size // block * block_bytes])
        self.release(self.raw)
        return MappedBlocks(cols, self.type_name, size)

    def select_rows(self, index: torch.Tensor) -> MappedBlocks:
        """Rows `index` (int64 [R]) as a copy of their bytes (a permutation of whole rows)."""
        rows = self.raw[index.numpy()]
        self.release(self.raw)
        return MappedBlocks(rows, self.type_name, self.k)


def decoded(weight: QuantizedWeight | MappedBlocks) -> QuantizedWeight:
    """`weight` as a QuantizedWeight (MappedBlocks decoded; the map's pages handed back)."""
    return weight.decode() if isinstance(weight, MappedBlocks) else weight


# A file's tensor larger than this (an LM head, an embedding) is decoded in row chunks of
# at most this many bytes of blocks: a load's decoded scratch stays one chunk's, whatever
# the vocabulary.
CHUNK_BYTES = 64 << 20
CHUNK_ROWS = 256  # chunks are whole tiles of the GEMM's output rows


def row_chunks(weight: QuantizedWeight | MappedBlocks) -> list[tuple[int, int]]:
    """(start, rows) of the chunks `weight` is decoded in: one, unless it is a file's
    tensor of more than CHUNK_BYTES."""
    n = weight.shape[0]
    if not isinstance(weight, MappedBlocks) or weight.nbytes <= CHUNK_BYTES:
        return [(0, n)]
    rows = max(CHUNK_ROWS, CHUNK_BYTES // weight.raw.shape[1] // CHUNK_ROWS * CHUNK_ROWS)
    return [(start, min(rows, n - start)) for start in range(0, n, rows)]


def dequantized(weight: QuantizedWeight | MappedBlocks, dtype: torch.dtype) -> torch.Tensor:
    """`weight` de-quantized to `dtype` [N, K], a file's large tensor chunk by chunk."""
    chunks = row_chunks(weight)
    if len(chunks) == 1:
        return decoded(weight).dequantize(dtype)
    out = torch.empty(weight.shape, dtype=dtype)
    for start, rows in chunks:
        out[start : start + rows] = weight.narrow_rows(start, rows).decode().dequantize(dtype)
    return out
