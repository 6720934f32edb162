"""Whole blocks between the KV cache tensors and host rows of raw bytes: pure functions.

A block's payload is, for each cache tensor in order, its `[2, block_size, kv_heads,
head_dim]` slice as raw bytes (K then V): the bytes the tensors hold, whatever their dtype
(a quantized cache's uint8 blocks with their scales inside included). One gather (save)
or one scatter (load) per tensor for all the step's blocks, never a copy per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Copies move whole words: the widest integer whose size divides every tensor's block
# bytes (index_select / index_copy_ on int64 run ~3x faster than on uint8).
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def byte_blocks(cache: torch.Tensor) -> torch.Tensor:
    """[2, num_blocks, ...] cache -> the same memory as uint8 [2, num_blocks, block bytes]."""
    return cache.view(torch.uint8).view(cache.shape[0], cache.shape[1], -1)


def block_nbytes(caches: Sequence[torch.Tensor]) -> int:
    """Bytes of one block over every tensor (a payload's length)."""
    return sum(byte_blocks(cache)[:, 0].nbytes for cache in caches)


def _word(caches: Sequence[torch.Tensor]) -> torch.dtype:
    widths = [byte_blocks(cache).shape[2] for cache in caches]
    return next(w for w in _WORDS if all(width % w.itemsize == 0 for width in widths))


def gather_blocks(caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """Rows [n, payload bytes] uint8 on the CPU (pinned beside a CUDA cache): row i is block
    block_ids[i]'s payload. The caller synchronizes a CUDA cache's stream before reading."""
    device, word = caches[0].device, _word(caches)
    n = len(block_ids)
    size = block_nbytes(caches) // word.itemsize
    rows = torch.empty((n, size), dtype=word, pin_memory=device.type == "cuda")  # [n, P words]
    ids = block_ids.to(device)
    offset = 0
    for cache in caches:
        flat = byte_blocks(cache).view(word)  # [2, num_blocks, E words]
        width = flat.shape[2]
        picked = flat.index_select(1, ids)  # [2, n, E]
        target = rows[:, offset : offset + 2 * width].view(n, 2, width)  # [n, 2, E]
        target.copy_(picked.transpose(0, 1), non_blocking=True)
        offset += 2 * width
    return rows.view(torch.uint8)


def scatter_blocks(
    caches: Sequence[torch.Tensor], block_ids: torch.Tensor, rows: torch.Tensor
) -> None:
    """Write rows [m, payload bytes] uint8 (row i: block block_ids[i]'s payload) into the
    caches. block_ids are distinct (one writer per block)."""
    device, word = caches[0].device, _word(caches)
    m = len(block_ids)
    ids = block_ids.to(device)
    source = rows.to(device, non_blocking=True).view(word)  # [m, P words]
    offset = 0
    for cache in caches:
        flat = byte_blocks(cache).view(word)  # [2, num_blocks, E words]
        width = flat.shape[2]
        block = source[:, offset : offset + 2 * width].view(m, 2, width)  # [m, 2, E]
        flat.index_copy_(1, ids, block.transpose(0, 1))
        offset += 2 * width
