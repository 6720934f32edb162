"""PlanBuilder: accumulates one step's scheduling decisions into a SchedulerOutput diff."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.lora_request import LoRARequest
from services.common.scheduler_output import (
    BlockTable,
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from services.scheduler.block_pool import KVCacheBlock
from services.scheduler.request import Request


@dataclass
class PlanBuilder:
    token_budget: int
    encoder_budget: int = 0  # image embeddings the step may still encode (encoder_budget.py)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_ids: list[str] = field(default_factory=list)
    cached_new_block_ids: list[BlockTable] = field(default_factory=list)
    cached_num_computed: list[int] = field(default_factory=list)
    cached_resumed: list[bool] = field(default_factory=list)
    cached_new_token_ids: list[list[int]] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    scheduled: list[Request] = field(default_factory=list)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts to verify

    def add_new(self, request: Request, block_table: BlockTable, num_tokens: int) -> None:
        """A request the worker does not hold: sent in full."""
        self.new_reqs.append(
            NewRequestData(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                kind=request.kind,
                block_table=block_table,
                num_computed_tokens=request.num_computed_tokens,
                images=request.images,
            )
        )
        self._schedule(request, num_tokens)

    def add_cached(
        self,
        request: Request,
        new_blocks: Sequence[Sequence[KVCacheBlock]] | BlockTable,
        num_tokens: int,
        replace_table: bool = False,
    ) -> None:
        """A request the worker holds: only the delta (or the whole table when it changed),
        per KV cache group."""
        ids = tuple(
            [b if isinstance(b, int) else b.block_id for b in blocks] for blocks in new_blocks
        )
        self.cached_ids.append(request.request_id)
        self.cached_new_block_ids.append(ids)
        self.cached_num_computed.append(request.num_computed_tokens)
        self.cached_resumed.append(replace_table)
        start = max(request.num_computed_tokens - request.num_prompt_tokens, 0)
        self.cached_new_token_ids.append(request.output_token_ids[start:])
        self._schedule(request, num_tokens)

    def _schedule(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens
        self.scheduled.append(request)

    def build(
        self,
        finished_req_ids: set[str],
        blocks_to_copy: list[tuple[int, int]],
        masks=None,
        loras: tuple[dict[str, int], dict[int, LoRARequest]] = ({}, {}),
        offload: tuple[list, list, list] = ([], [], []),
    ) -> SchedulerOutput:
        """The plan; `masks` (StepMasks) are the grammar bitmasks of this step's rows,
        `loras` the rows' adapter slots and the slots' adapters (LoRASlotTable.assign),
        `offload` the KV offload tiers' (kv_drops, kv_loads, kv_saves)."""
        cached = CachedRequestData(
            request_ids=self.cached_ids,
            new_block_ids=self.cached_new_block_ids,
            num_computed_tokens=self.cached_num_computed,
            resumed_from_preemption=self.cached_resumed,
            new_token_ids=self.cached_new_token_ids,
        )
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            blocks_to_copy=blocks_to_copy,
            blocks_to_swap_in=self.blocks_to_swap_in,
            blocks_to_swap_out=self.blocks_to_swap_out,
            grammar_request_ids=masks.request_ids if masks else [],
            grammar_bitmask=masks.bitmask if masks else b"",
            scheduled_spec_decode_tokens=self.spec_token_ids,
            lora_slots=loras[0],
            lora_adapters=loras[1],
            kv_drops=offload[0],
            kv_loads=offload[1],
            kv_saves=offload[2],
        )
