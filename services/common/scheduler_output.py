"""SchedulerOutput: one step's plan for the workers, in vLLM's diff form.

New requests are sent once in full; requests the worker already holds are sent as
deltas (columns of parallel lists); finished ids ride on the next plan. The worker
keeps per-request state between steps and appends the tokens it samples itself; cached
requests also carry their newest output tokens, so the ranks of a worker group that do not
sample keep the same state as the one that does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.image_input import ImageInput
from services.common.lora_request import LoRARequest
from services.common.pooling_params import PoolingParams
from services.common.sampling_params import SamplingParams

# What a request asks of the worker, told apart by type: SamplingParams (it generates) or
# PoolingParams (its prompt is run, nothing is sampled, and its final pooled vector comes
# back in the step that ends the prompt: RunnerOutput.pooled).
RequestKind = SamplingParams | PoolingParams

# Block ids per KV cache group (layers sharing one table), each list one id per block
# position: group g's block for tokens pos * block_size .. is table[g][pos]. Every group
# has as many positions; one group of full attention is the plain case.
BlockTable = tuple[list[int], ...]


@dataclass(frozen=True)
class NewRequestData:
    """A request the worker has not seen (or has dropped, after a preemption or fork)."""

    request_id: str
    prompt_token_ids: list[int]
    # Tokens generated before this request reached the worker (resumed after a
    # recompute preemption, or a forked n > 1 / beam sequence). Empty for fresh ones.
    output_token_ids: list[int]
    kind: RequestKind
    block_table: BlockTable  # the whole table
    num_computed_tokens: int  # tokens already in the KV cache (prefix hits, forks)
    images: tuple[ImageInput, ...] = ()  # the prompt's images (image_input.py)


@dataclass(frozen=True)
class CachedRequestData:
    """Deltas for requests the worker already holds, as parallel columns."""

    request_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks appended this step
    num_computed_tokens: list[int] = field(default_factory=list)
    # True when the request comes back from swap: new_block_ids is then its whole table.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    # Output tokens from max(num_computed_tokens, prompt length) on: what a rank that does
    # not sample (tensor/pipeline parallelism) lacks. Empty list: not sent.
    new_token_ids: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # request_id -> number of tokens to run this step, for every scheduled request.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the worker must drop (finished, aborted, preempted by recompute, pruned beams).
    finished_req_ids: set[str] = field(default_factory=set)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on device
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    # Structured outputs: the requests whose token this step is constrained, and their
    # allowed tokens as packed bits, int32 little-endian [len(ids), ceil(vocab / 32)]
    # (bit t of word t // 32 set: token t allowed).
    grammar_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: bytes = b""
    # Speculative decoding: request_id -> the proposed tokens scheduled after its last known
    # token (its num_scheduled_tokens counts them). The worker verifies them in this step.
    # With a grammar, such a request has one bitmask row per verified position, in order.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # LoRA: request_id -> the adapter slot its rows use (absent: the base model), and every
    # slot this step uses with the adapter it holds (a worker loads the ones it lacks).
    lora_slots: dict[str, int] = field(default_factory=dict)
    lora_adapters: dict[int, LoRARequest] = field(default_factory=dict)
    # KV offload tiers (the worker's kv_offload store, the scheduler's index of it), applied
    # in this order: kv_drops, keys a tier forgets ((key, "host" | "disk")); kv_loads,
    # (key, device block) read back from host memory or disk before the forward; after the
    # forward, kv_saves, (device block, key) of blocks full now, copied out to every tier.
    # A key is a block hash (32 bytes).
    kv_drops: list[tuple[bytes, str]] = field(default_factory=list)
    kv_loads: list[tuple[bytes, int]] = field(default_factory=list)
    kv_saves: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
