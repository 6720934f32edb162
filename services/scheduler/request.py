"""Request: one sequence's state in the engine core."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.common.block_hash import BlockHash, hash_request_tokens
from services.common.engine_output import EngineCoreOutput
from services.common.engine_request import EngineCoreRequest, check_request_kind
from services.common.image_input import ImageInput
from services.common.lora_request import LoRARequest
from services.common.pooling_params import PoolingParams
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import RequestKind, SchedulerOutput


class RequestStatus(enum.IntEnum):
    """Ordered so that `status > SWAPPED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    SWAPPED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_IGNORED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.SWAPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    # Exactly one of sampling_params (it generates) and pooling_params (it pools: a prefill
    # that samples nothing; see is_pooling) is set.
    sampling_params: SamplingParams | None = None
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base)
    client_id: int = 0
    # n > 1: the request every sequence of the group belongs to, and this sequence's index.
    parent_request_id: str | None = None
    index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    # Structured outputs: the sequence's grammar state (structured_output_manager.py).
    grammar: object | None = field(default=None, repr=False)
    # Reasoning models: the sequence's place against its thinking (reasoning_phase.py).
    reasoning: object | None = field(default=None, repr=False)
    # Why it ended with finish reason "error", and what kind (EngineCoreOutput.error_code).
    error: str | None = None
    error_code: str | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first scheduling (reported to clients)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    block_size: int = 16
    # n > 1 groups are prefilled once as this request, then forked into n sequences.
    pending_fork: bool = False
    beam_group: str | None = None  # the beam-search group this sequence is a beam of
    first_scheduled_time: float | None = None
    # The plan this request's current step rides on, from schedule() until its output is
    # processed (or the request ends); None when no step of it is in flight.
    step_in_flight: SchedulerOutput | None = None
    # Speculative decoding: the worker's proposals to follow the last token, to be verified
    # in the request's next step (consumed when it is scheduled).
    spec_token_ids: list[int] = field(default_factory=list)
    # Pooling: the request's params, and whether the pooler reads every prompt position
    # (MEAN, CLS: no prefix-cache hits, which would skip positions; LAST reads only the
    # last one, which is always computed).
    pooling_params: PoolingParams | None = None
    pools_every_position: bool = False
    # The prompt's images: placeholder spans (charged to the step's encoder budget), content
    # hashes (in the block hashes) and pixels (for the worker).
    images: tuple[ImageInput, ...] = ()

    @classmethod
    def from_engine_request(cls, req: EngineCoreRequest, block_size: int) -> Request:
        params = req.sampling_params
        if params is not None and req.extra_stop_token_ids and not params.ignore_eos:
            params = params.clone()
            params.all_stop_token_ids = params.all_stop_token_ids | set(req.extra_stop_token_ids)
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt or None,
            lora_request=req.lora_request,
            block_size=block_size,
            pooling_params=req.pooling_params,
            images=req.images,
        )

    def __post_init__(self) -> None:
        check_request_kind(self.sampling_params, self.pooling_params)
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.pending_fork = self.num_sequences > 1 and not self.uses_beam_search
        self.update_block_hashes()

    @property
    def kind(self) -> RequestKind:
        """What it asks, told apart by type: its SamplingParams or its PoolingParams."""
        return self.sampling_params if self.pooling_params is None else self.pooling_params

    @property
    def is_pooling(self) -> bool:
        """A pooling request: it has no sampling_params, and every path that reads them
        asks this first (or goes through the properties below)."""
        return self.pooling_params is not None

    @property
    def num_sequences(self) -> int:
        """The sequences it becomes: n (1 for a pooling request)."""
        return 1 if self.is_pooling else self.sampling_params.n

    @property
    def uses_beam_search(self) -> bool:
        return not self.is_pooling and self.sampling_params.use_beam_search

    @property
    def lora_identity(self) -> str | None:
        return self.lora_request.identity if self.lora_request else None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens not yet in the KV cache; a group waiting to fork stops one short."""
        target = self.num_prompt_tokens - 1 if self.pending_fork else self.num_tokens
        return max(target - self.num_computed_tokens, 0)

    @property
    def needs_every_prompt_position(self) -> bool:
        """Prompt logprobs, or a pooler that reads all positions: no prefix-cache hits."""
        if self.is_pooling:
            return self.pools_every_position
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def in_flight(self) -> bool:
        """A step of this request is on the worker(s) and its output is not processed yet."""
        return self.step_in_flight is not None

    @property
    def group_id(self) -> str:
        return self.parent_request_id or self.request_id

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Extend block_hashes over every newly completed full block of tokens."""
        if self.num_tokens // self.block_size <= len(self.block_hashes):
            return
        self.block_hashes = hash_request_tokens(
            self.all_token_ids,
            self.block_size,
            self.block_hashes,
            self.cache_salt,
            self.lora_identity,
            self.images,
        )

    def to_output(
        self, new_ids, logprobs=None, prompt_logprobs=None, pooled=None
    ) -> EngineCoreOutput:
        """This step's output for the client (queue time on the first token only; a
        pooling request's final output carries its pooled vector)."""
        queued_s = None
        first = new_ids and self.num_output_tokens == len(new_ids)
        if first and self.first_scheduled_time is not None:
            queued_s = max(self.first_scheduled_time - self.arrival_time, 0.0)
        return EngineCoreOutput(
            request_id=self.request_id,
            new_token_ids=new_ids,
            finish_reason=self.status.finish_reason,
            stop_reason=self.stop_reason,
            new_logprobs=logprobs,
            new_prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            parent_request_id=self.parent_request_id,
            index=self.index,
            queued_s=queued_s,
            error=self.error,
            error_code=self.error_code,
            pooled=pooled,
        )
