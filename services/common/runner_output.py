"""RunnerOutput: what a worker returns for one SchedulerOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs at one position: the chosen token first, then the top-k alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1-based rank of each token in the full distribution


@dataclass(frozen=True)
class StepTimings:
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


@dataclass(frozen=True)
class RunnerOutput:
    # Parallel columns over the requests scheduled this step.
    request_ids: list[str] = field(default_factory=list)
    # Sampled ids per request; empty for a request in the middle of a chunked prefill.
    # With speculation: the accepted proposals and then the target's own token.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # request_id -> logprobs of each sampled token (only when sampling_params.logprobs is set).
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # request_id -> logprobs of the prompt tokens computed this step (first one is None).
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    timings: StepTimings = field(default_factory=StepTimings)
    # Speculative decoding: request_id -> the tokens proposed to follow its new tokens,
    # for the scheduler to schedule next step (requests without proposals are absent).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> why its step could not run as asked (its LoRA adapter would not load):
    # the scheduler ends it with finish reason "error" and that message.
    request_errors: dict[str, str] = field(default_factory=dict)
    # Pooling requests whose prompt ended this step: request_id -> its final pooled vector
    # [out] float32 (pooled, through the head, truncated and normalized as asked).
    pooled: dict[str, np.ndarray] = field(default_factory=dict)
    # KV offload: keys of this step's kv_loads that could not be read (file gone, truncated,
    # checksum or identity wrong); the scheduler forgets them and recomputes what they held.
    kv_load_failures: list[bytes] = field(default_factory=list)
