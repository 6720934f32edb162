"""The stand-in worker with KV offload tiers: a dict of blocks' cells per key, as the real
store (services/worker/kv_offload/) executes a plan's kv_drops, kv_loads and kv_saves.

Drops, then loads (before the forward), then the forward, then saves (after it), as
SchedulerOutput's contract orders them. `corrupt(key)` makes the next load of a key fail
the way a truncated file does: the key is listed in kv_load_failures, the block keeps
garbage, and every row reading it (then or in a later step) "samples" garbage (a token no
reference gives), so a scheduler that kept such a row's output fails the test.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput
from tests.scheduler.stand_in_worker import VOCAB_SIZE, Cell, StandInWorker

GARBAGE_TOKEN = VOCAB_SIZE  # outside the stand-in model's vocabulary
GARBAGE_CELL: Cell = (-1, -1, None)  # what a failed load leaves in its block


@dataclass
class OffloadStandInWorker(StandInWorker):
    tiers: dict[str, dict[bytes, list[Cell | None]]] = field(
        default_factory=lambda: {"host": {}, "disk": {}}
    )
    corrupted: set[bytes] = field(default_factory=set)
    num_loads: int = 0
    num_saves: int = 0

    def corrupt(self, key: bytes) -> None:
        self.corrupted.add(key)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        for key, tier in plan.kv_drops:
            self.tiers[tier].pop(key, None)
        failed = []
        for key, block in plan.kv_loads:
            cells = self._find(key)
            if cells is None or key in self.corrupted:
                failed.append(key)
                cells = [GARBAGE_CELL] * self.block_size
            else:
                self.num_loads += 1
            self.kv[block * self.block_size : (block + 1) * self.block_size] = cells
        self.corrupted -= set(failed)
        garbage = self._rows_reading(plan)
        # The rows that read a failed block run on garbage (their state stays held): what
        # they write is garbage too.
        for rid, (blocks, start) in garbage.items():
            for pos in range(start, start + plan.num_scheduled_tokens[rid]):
                self.kv[self._slot_of(blocks, pos)] = GARBAGE_CELL
        rows = {r: n for r, n in plan.num_scheduled_tokens.items() if r not in garbage}
        output = super().execute(replace(plan, num_scheduled_tokens=rows))
        output = replace(
            output,
            request_ids=[*output.request_ids, *garbage],
            sampled_token_ids=[*output.sampled_token_ids, *([GARBAGE_TOKEN] for _ in garbage)],
            kv_load_failures=failed,
        )
        for block, key in plan.kv_saves:
            cells = self.kv[block * self.block_size : (block + 1) * self.block_size]
            for store in self.tiers.values():
                store[key] = list(cells)
            self.num_saves += 1
        return output

    def _find(self, key: bytes) -> list[Cell | None] | None:
        for store in self.tiers.values():
            if key in store:
                return store[key]
        return None

    def _rows_reading(self, plan: SchedulerOutput) -> dict[str, tuple[list[int], int]]:
        """The rows whose computed positions (before this step's) hold garbage: their
        blocks and computed tokens."""
        rows = {
            n.request_id: (n.block_table[0], n.num_computed_tokens) for n in plan.scheduled_new_reqs
        }
        cached = plan.scheduled_cached_reqs
        for i, rid in enumerate(cached.request_ids):
            held = [] if cached.resumed_from_preemption[i] else self.states[rid].block_ids
            rows[rid] = ([*held, *cached.new_block_ids[i][0]], cached.num_computed_tokens[i])
        return {
            rid: (blocks, num_computed)
            for rid, (blocks, num_computed) in rows.items()
            if rid in plan.num_scheduled_tokens
            and any(self.kv[self._slot_of(blocks, p)] == GARBAGE_CELL for p in range(num_computed))
        }

    def _slot_of(self, blocks: list[int], position: int) -> int:
        return blocks[position // self.block_size] * self.block_size + position % self.block_size
