"""EngineCoreRequest: what a frontend sends the engine core for one request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.common.lora_request import LoRARequest
from services.common.pooling_params import PoolingParams
from services.common.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    # EOS ids of the model's generation_config beyond the first: they stop like stop ids.
    extra_stop_token_ids: tuple[int, ...] = ()
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    # A pooling request (a prefill that samples nothing and returns its pooled hidden
    # state); its sampling_params are unused.
    pooling_params: PoolingParams | None = None
    arrival_time: float = field(default_factory=time.monotonic)
