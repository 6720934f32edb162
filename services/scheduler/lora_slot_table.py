"""LoRASlotTable: which adapter sits in which worker slot, and admission by max_loras.

The adapters of the running requests never number more than max_loras (a waiting or
swapped request whose adapter would be one too many waits), and each of them keeps its
slot while any running request uses it; a slot whose adapter no running request uses is
free for another (its old contents are reused if that adapter comes back first). Every
plan names the slot of each row that has an adapter and the adapter of every slot it uses,
so a restarted worker reloads what it lacks from the plan alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.lora_request import LoRARequest
from services.scheduler.request import Request


class LoRASlotTable:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slots: list[LoRARequest | None] = [None] * max_loras
        self._last_used = [0] * max_loras
        self._step = 0

    def fits(self, request: Request, running: Iterable[Request]) -> bool:
        """Whether `request` may join `running` without a (max_loras + 1)th adapter."""
        if request.lora_request is None:
            return True
        active = _active(running)
        return request.lora_identity in active or len(active) < self.max_loras

    def assign(
        self, scheduled: list[Request], running: Iterable[Request]
    ) -> tuple[dict[str, int], dict[int, LoRARequest]]:
        """(request_id -> slot, slot -> adapter) for the scheduled requests with one."""
        self._step += 1
        needed = {r.lora_identity: r.lora_request for r in scheduled if r.lora_request}
        if not needed:
            return {}, {}
        active = _active(running) | set(needed)
        slot_of = {lora.identity: i for i, lora in enumerate(self.slots) if lora is not None}
        for identity, lora in needed.items():
            if identity not in slot_of:
                slot = self._free_slot(active)
                if (old := self.slots[slot]) is not None:
                    slot_of.pop(old.identity, None)
                self.slots[slot] = lora
                slot_of[identity] = slot
            self._last_used[slot_of[identity]] = self._step
        rows = {r.request_id: slot_of[r.lora_identity] for r in scheduled if r.lora_request}
        return rows, {slot_of[identity]: lora for identity, lora in needed.items()}

    def _free_slot(self, active: set[str]) -> int:
        """An empty slot, else the least recently used one no running request needs."""
        free = [
            i for i, lora in enumerate(self.slots) if lora is None or lora.identity not in active
        ]
        if not free:
            raise RuntimeError("more adapters are running than there are LoRA slots")
        return min(free, key=lambda i: (self.slots[i] is not None, self._last_used[i]))


def _active(running: Iterable[Request]) -> set[str]:
    return {r.lora_identity for r in running if r.lora_request is not None}
