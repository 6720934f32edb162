"""LoRASlots: the adapters of the current steps, stacked per linear slice, on the device.

Slot s of every slice holds A [R, in] and B [out, R] (R = max_lora_rank; an adapter of
rank r fills the first r, a module it does not target stays zero). `batch` is the current
step's rows by slot, which every LoRA-carrying linear reads (LinearLoRA.add); None when no
row of the step has an adapter, and then the linears add nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from services.common.lora_config import LoRAConfig
from services.worker.lora.adapter_weights import AdapterWeights
from services.worker.lora.lora_layout import SliceLayout, linears_of, slice_layouts


@dataclass
class LoRASlice:
    layout: SliceLayout
    a: torch.Tensor  # [S, R, in_size] float32
    b: torch.Tensor  # [S, out_size, R] float32


@dataclass(frozen=True)
class LoRABatch:
    """One step's rows with an adapter."""

    token_slots: torch.Tensor  # [T] int32 each row's slot, -1 for none (device)
    groups: list[tuple[int, int, torch.Tensor]]  # (slot, rank, rows [n] int64 on the device)


class LinearLoRA:
    """The LoRA add of one fused linear: y[:, slice] += B (A x) for the rows of each slot."""

    def __init__(self, slots: LoRASlots, slices: list[LoRASlice]) -> None:
        self.slots = slots
        self.slices = slices

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x [T, in] the linear's input, y [T, out] its output (updated in place)."""
        batch = self.slots.batch
        if batch is None:
            return
        if x.is_cuda:
            from pagestream_kernels.triton import add_lora

            ranks, offsets = self.slots.ranks, [part.layout.out_offset for part in self.slices]
            for part, offset in zip(self.slices, offsets, strict=True):
                add_lora(y, x, part.a, part.b, batch.token_slots, ranks, offset)
            return
        for slot, rank, rows in batch.groups:
            xs = x.index_select(0, rows).float()  # [n, in]
            for part in self.slices:
                shrunk = xs @ part.a[slot, :rank].t()  # [n, r]
                delta = shrunk @ part.b[slot, :, :rank].t()  # [n, out_size]
                start = part.layout.out_offset
                y[:, start : start + part.layout.out_size].index_add_(0, rows, delta.to(y.dtype))


class LoRASlots:
    """Slot tensors for every decoder layer of this stage (see the module docstring)."""

    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device) -> None:
        self.config = config
        num_slots, rank = config.max_loras, config.max_lora_rank
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.ranks_host = [0] * num_slots
        self.identities: list[str | None] = [None] * num_slots
        self.batch: LoRABatch | None = None
        # Whether the torch modules run (they read batch.groups); the native step groups
        # the rows itself, so bind_lora turns this off.
        self.group_rows = True
        # Called with a slot's index after an adapter was written into it (the native
        # step copies the slot into its own layout).
        self.on_load: list[Callable[[int], None]] = []
        # (layer index, fused linear name) -> its slices
        self.linears: dict[tuple[int, str], list[LoRASlice]] = {}
        decoder = model.model
        for index in decoder.layer_range:
            for name, linear in linears_of(decoder.layers[index]).items():
                slices = [
                    LoRASlice(
                        layout,
                        torch.zeros(num_slots, rank, layout.in_size, device=device),
                        torch.zeros(num_slots, layout.out_size, rank, device=device),
                    )
                    for layout in slice_layouts(name, linear)
                ]
                self.linears[(index, name)] = slices
                linear.lora = LinearLoRA(self, slices)

    def layouts(self) -> dict[tuple[int, str], SliceLayout]:
        """(layer, HF module) -> this rank's slice of it."""
        return {
            (index, part.layout.module): part.layout
            for (index, _), slices in self.linears.items()
            for part in slices
        }

    def load(self, slot: int, adapter: AdapterWeights) -> None:
        """Writes `adapter` into `slot` (in place; then the on_load listeners run)."""
        for (index, _), slices in self.linears.items():
            for part in slices:
                part.a[slot].zero_()
                part.b[slot].zero_()
                pair = adapter.tensors.get((index, part.layout.module))
                if pair is not None:
                    a, b = pair
                    part.a[slot, : adapter.rank].copy_(a)
                    part.b[slot, :, : adapter.rank].copy_(b)
        self.ranks[slot] = adapter.rank
        self.ranks_host[slot] = adapter.rank
        self.identities[slot] = adapter.identity
        for listener in self.on_load:
            listener(slot)

    def clear(self, slot: int) -> None:
        """Empties `slot` (rank 0: its rows get nothing added)."""
        self.ranks[slot] = 0
        self.ranks_host[slot] = 0
        self.identities[slot] = None

    def set_batch(self, token_slots: np.ndarray | None) -> None:
        """The step's rows: token_slots [T] int32, row t's slot or -1 (None: no adapter)."""
        if token_slots is None or not (token_slots >= 0).any():
            self.batch = None
            return
        device = self.ranks.device
        groups = []
        used = np.unique(token_slots[token_slots >= 0]).tolist() if self.group_rows else []
        for slot in used:
            if self.ranks_host[slot] > 0:
                rows = torch.from_numpy(np.flatnonzero(token_slots == slot)).to(device)
                groups.append((slot, self.ranks_host[slot], rows))
        slots = torch.from_numpy(token_slots.astype(np.int32)).to(device)
        self.batch = LoRABatch(slots, groups)
