"""EngineCoreRequest: what a frontend sends the engine core for one request.

A request is one of two kinds: a generation (`sampling_params`) or a pooling request
(`pooling_params`: a prefill that samples nothing and returns its pooled vector).
Exactly one is set (`check_request_kind`, also the engine core's Request's rule); on the
wire it is AddRequest's `oneof kind`, and the worker's NewRequestData holds one `kind`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.common.image_input import ImageInput, check_images
from services.common.lora_request import LoRARequest
from services.common.pooling_params import PoolingParams
from services.common.sampling_params import SamplingParams


def check_request_kind(
    sampling_params: SamplingParams | None, pooling_params: PoolingParams | None
) -> None:
    """ValueError unless exactly one of the two is set."""
    if (sampling_params is None) == (pooling_params is None):
        got = "neither" if sampling_params is None else "both"
        raise ValueError(
            "a request needs exactly one of sampling_params (a generation) and "
            f"pooling_params (a pooling request), got {got}."
        )


@dataclass(frozen=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None = None
    eos_token_id: int | None = None
    # EOS ids of the model's generation_config beyond the first: they stop like stop ids.
    extra_stop_token_ids: tuple[int, ...] = ()
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    pooling_params: PoolingParams | None = None
    # the prompt's images, in prompt order (services/common/image_input.py)
    images: tuple[ImageInput, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        check_request_kind(self.sampling_params, self.pooling_params)
        check_images(self.images, len(self.prompt_token_ids))
