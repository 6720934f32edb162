"""The worker's paged KV cache: per-layer device tensors, a CPU swap pool, block moves.

Per layer one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = keys,
1 = values; a q8_0 cache's last dim is each head's uint8 row, see KVCacheSpec) on the
device, and one of the same shape with ``num_cpu_blocks`` on the CPU (pinned when the
device is CUDA). Block ids are the scheduler's: device ids index
``kv_caches``, CPU ids index ``cpu_cache``. Also the sizing math: bytes per block, blocks
for a byte budget, and profiling the free GPU memory after a dummy forward pass.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable, Sequence

import torch

from services.worker.models.kv_cache_spec import KVCacheSpec

logger = logging.getLogger(__name__)

_GIB = 1024**3


class CacheEngine:
    """Owns the KV cache tensors of every layer and moves whole blocks between them."""

    def __init__(
        self,
        spec: KVCacheSpec,
        block_size: int,
        num_blocks: int,
        num_cpu_blocks: int,
        device: torch.device | str,
    ) -> None:
        """`spec.num_tensors` cache tensors of the spec's shape and dtype; each model layer
        uses its own, or `spec.layer_slots[i]` when layers share them (KV cache groups)."""
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}.")
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.dtype = dtype = spec.dtype
        num_layers = spec.num_tensors
        block_shape = spec.layer_shape(num_blocks, block_size)[2:]  # q8_0: a head's bytes last
        # Zeroed, not empty: stale NaN bit patterns must never reach a masked attention read.
        self.kv_caches: list[torch.Tensor] = [
            zeroed((2, num_blocks, *block_shape), dtype, self.device) for _ in range(num_layers)
        ]  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        slots = spec.layer_slots or range(num_layers)
        self.layer_caches = [self.kv_caches[s] for s in slots]  # what each model layer uses
        pin = self.device.type == "cuda"
        # Empty, not zeroed: a swap block is always written (swap_out) before it is read, and
        # untouched pages of a large swap pool then cost no memory.
        self.cpu_cache: list[torch.Tensor] = [
            torch.empty((2, num_cpu_blocks, *block_shape), dtype=dtype, pin_memory=pin)
            for _ in range(num_layers)
        ]  # per layer [2, num_cpu_blocks, block_size, num_kv_heads, head_dim]
        logger.info(
            "KV cache: %d layers x %d blocks of %d tokens on %s (%.2f GiB), %d CPU blocks",
            num_layers,
            num_blocks,
            block_size,
            self.device,
            num_layers * self.kv_caches[0].nbytes / _GIB,
            num_cpu_blocks,
        )

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device block ``src`` to device block ``dst`` for every (src, dst) pair."""
        if not pairs:
            return
        src = _block_ids([s for s, _ in pairs], self.num_blocks, "copy_blocks source", self.device)
        dst = _block_ids([d for _, d in pairs], self.num_blocks, "copy_blocks target", self.device)
        for cache in self.kv_caches:
            # index_select gathers into a new tensor first, so chained pairs read old contents.
            cache.index_copy_(1, dst, cache.index_select(1, src))

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks: pairs of (device_block, cpu_block)."""
        if not pairs:
            return
        src = _block_ids([s for s, _ in pairs], self.num_blocks, "swap_out device", self.device)
        dst = _block_ids([d for _, d in pairs], self.num_cpu_blocks, "swap_out CPU", "cpu")
        for device_cache, cpu_cache in zip(self.kv_caches, self.cpu_cache, strict=True):
            # Blocking copy: the CPU scatter below must see the finished transfer.
            cpu_cache.index_copy_(1, dst, device_cache.index_select(1, src).cpu())

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy CPU blocks to device blocks: pairs of (cpu_block, device_block)."""
        if not pairs:
            return
        src = _block_ids([s for s, _ in pairs], self.num_cpu_blocks, "swap_in CPU", "cpu")
        dst = _block_ids([d for _, d in pairs], self.num_blocks, "swap_in device", self.device)
        for device_cache, cpu_cache in zip(self.kv_caches, self.cpu_cache, strict=True):
            device_cache.index_copy_(1, dst, cpu_cache.index_select(1, src).to(self.device))


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU its memory is a private anonymous mapping, which the
    kernel hands out zero-filled page by page as it is first written: a KV cache's pages
    become resident as its blocks are first used, not all at start (a 4 GiB default cache
    costs nothing until requests fill it), and never hold stale bit patterns."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # torch.frombuffer holds a reference to the mapping for the tensor's lifetime
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def _block_ids(
    ids: list[int], num_blocks: int, what: str, device: torch.device | str
) -> torch.Tensor:
    """Validated int64 index tensor of block ids (a bad id is a clear error, not a crash)."""
    bad = [i for i in ids if not 0 <= i < num_blocks]
    if bad:
        raise ValueError(f"{what} block ids {bad[:8]} are out of range [0, {num_blocks}).")
    return torch.tensor(ids, dtype=torch.int64, device=device)


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers: 2 (K and V) * L * block_size * kv_heads * hd."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """How many whole blocks fit in ``budget_bytes``; ValueError when not even one does."""
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}.")
    num_blocks = int(budget_bytes // bytes_per_block)
    if num_blocks < 1:
        raise ValueError(
            f"The KV cache budget of {int(budget_bytes)} bytes ({budget_bytes / _GIB:.3f} GiB) "
            f"holds no KV block of {bytes_per_block} bytes; raise --kv-cache-memory "
            "(CPU) or --gpu-memory-utilization (CUDA), or use a smaller --block-size."
        )
    return num_blocks


def profile_num_gpu_blocks(
    run_dummy_forward: Callable[[], None],
    bytes_per_block: int,
    gpu_memory_utilization: float,
    device: torch.device | str,
) -> int:
    """Blocks that fit in ``total * utilization`` beside the peak of a dummy forward (CUDA only).

    peak_used = memory in use on the device after the run (weights, CUDA context, other
    processes) + the transient extra torch allocated at the run's peak.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            f"profile_num_gpu_blocks needs a CUDA device, got {device}; on CPU size the cache "
            "from an explicit budget with num_blocks_for_budget (--kv-cache-memory)."
        )
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}.")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_dummy_forward()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    transient = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    peak_used = (total - free) + transient
    num_blocks = num_blocks_from_profile(total, gpu_memory_utilization, peak_used, bytes_per_block)
    logger.info(
        "Memory profile: total %.2f GiB, utilization %.2f, peak used %.2f GiB -> %d KV blocks",
        total / _GIB,
        gpu_memory_utilization,
        peak_used / _GIB,
        num_blocks,
    )
    return num_blocks


def num_blocks_from_profile(
    total_bytes: int, gpu_memory_utilization: float, peak_used_bytes: int, bytes_per_block: int
) -> int:
    """``(total * utilization - peak_used) // bytes_per_block``, ValueError when < 1."""
    budget = int(total_bytes * gpu_memory_utilization) - peak_used_bytes
    if budget < bytes_per_block:
        raise ValueError(
            f"No room for the KV cache: {gpu_memory_utilization:.2f} of "
            f"{total_bytes / _GIB:.2f} GiB is {total_bytes * gpu_memory_utilization / _GIB:.2f} "
            f"GiB, but the model's peak use is already {peak_used_bytes / _GIB:.2f} GiB and one "
            f"KV block needs {bytes_per_block} bytes; raise --gpu-memory-utilization or lower "
            "--max-num-batched-tokens / --max-num-seqs."
        )
    return num_blocks_for_budget(budget, bytes_per_block)
