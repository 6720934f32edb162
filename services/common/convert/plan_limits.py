"""PlanLimits: what a worker can run, and the checks a plan decoded from the wire passes.

A plan built in-process is trusted (the scheduler admits nothing past max_model_len and
builds its columns parallel); a plan from the wire is checked here once, against the
worker's limits, with an error naming the field. What only the worker's state can tell
(ids it does not hold, the room left in a request's row) the InputBatch checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.scheduler_output import SchedulerOutput

# KV offload: a key is a block hash (sha256), a tier one of these; a plan drops at most
# MAX_KV_DROPS keys (the scheduler sends more over the next plans) and loads and saves
# at most one per device block.
KV_KEY_BYTES = 32
KV_TIERS = ("host", "disk")
MAX_KV_DROPS = 1 << 16


@dataclass(frozen=True)
class PlanLimits:
    max_model_len: int
    block_size: int
    vocab_size: int
    num_kv_groups: int = 1
    num_blocks: int = 0  # the device's KV blocks: the range of offload block ids (0: unchecked)

    @property
    def max_positions(self) -> int:
        """Block positions of the longest sequence."""
        return -(-self.max_model_len // self.block_size)

    def check(self, plan: SchedulerOutput) -> None:
        """Raises ValueError naming the field a plan exceeds these limits by."""
        for new in plan.scheduled_new_reqs:
            self._check_new(
                new.request_id, new.block_table, new.prompt_token_ids, new.output_token_ids
            )
        for request_id, table in zip(
            plan.scheduled_cached_reqs.request_ids,
            plan.scheduled_cached_reqs.new_block_ids,
            strict=True,
        ):
            self._check_groups(f"cached_new_block_ids of {request_id!r}", table)
        new_lengths = {
            n.request_id: len(n.prompt_token_ids) + len(n.output_token_ids)
            for n in plan.scheduled_new_reqs
        }
        for request_id, drafts in plan.scheduled_spec_decode_tokens.items():
            if any(not 0 <= t < self.vocab_size for t in drafts):
                raise ValueError(
                    f"spec_token_ids: the proposals of {request_id!r} hold token ids outside "
                    f"the vocabulary (0..{self.vocab_size - 1})"
                )
            if (
                request_id in new_lengths
                and new_lengths[request_id] + len(drafts) + 1 > self.max_model_len
            ):
                raise ValueError(
                    f"spec_token_ids: the proposals of {request_id!r} would exceed "
                    f"max_model_len {self.max_model_len}"
                )
        self._check_offload(plan)

    def _check_offload(self, plan: SchedulerOutput) -> None:
        if len(plan.kv_drops) > MAX_KV_DROPS:
            raise ValueError(f"kv_drops: {len(plan.kv_drops)} keys, at most {MAX_KV_DROPS}")
        blocks = {
            "kv_loads": [block for _, block in plan.kv_loads],
            "kv_saves": [block for block, _ in plan.kv_saves],
        }
        for name, ids in blocks.items():
            if not self.num_blocks:
                continue
            if len(ids) > self.num_blocks:
                raise ValueError(f"{name}: {len(ids)} blocks, the device has {self.num_blocks}")
            if any(not 0 <= i < self.num_blocks for i in ids):
                raise ValueError(f"{name}: a block id outside 0..{self.num_blocks - 1}")
        if len(set(blocks["kv_loads"])) != len(blocks["kv_loads"]):
            raise ValueError("kv_loads: two keys loaded into one block")

    def _check_new(self, request_id: str, table, prompt: list[int], output: list[int]) -> None:
        num_tokens = len(prompt) + len(output)
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"new_requests: request {request_id!r} has {num_tokens} tokens "
                f"({len(prompt)} prompt); allowed 1..{self.max_model_len} (max_model_len)"
            )
        self._check_groups(f"block_ids of {request_id!r}", table)
        if len(table[0]) > self.max_positions:
            raise ValueError(
                f"new_requests: request {request_id!r} would hold {len(table[0])} blocks "
                f"per KV cache group; max_model_len allows {self.max_positions}"
            )

    def _check_groups(self, name: str, table) -> None:
        if len(table) != self.num_kv_groups:
            raise ValueError(
                f"{name}: {len(table)} KV cache groups, the worker has {self.num_kv_groups}"
            )
