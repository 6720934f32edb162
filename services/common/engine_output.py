"""What the engine core sends to its clients (frontends) after each step."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from services.common.runner_output import TokenLogprobs


@dataclass(frozen=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # stop, length, abort, error
    stop_reason: int | str | None = None  # the stop token id (or the stop string, set by frontends)
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    # n > 1: the client's request id and this sequence's index within it.
    parent_request_id: str | None = None
    index: int = 0
    error: str | None = None
    # With `error`: None (the request is bad), "unavailable" (the engine cannot serve
    # now), "resource_exhausted" (overloaded: retry later) or "internal" (the engine's
    # fault). engine.proto's ErrorCode has one value for each.
    error_code: str | None = None
    cumulative_logprob: float | None = None  # set on beam-search results
    queued_s: float | None = None  # arrival to first scheduling, on a request's first output
    # A pooling request's result, on its final output: the pooled hidden state [hidden]
    # float32, before the request's truncation and normalization (PoolingParams.finish).
    pooled: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_swapped_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Speculative decoding, cumulative (vLLM's spec_decode_* counters): sequences that got
    # proposals verified, tokens proposed, proposals accepted, and accepted per position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # LoRA: the adapters (by name) of running and of waiting requests, and the slots.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    # KV offload tiers, cumulative: prompt tokens read back from them on prefix hits (also
    # in prefix_cache_hits), and blocks whose read failed (recomputed).
    kv_offload_hits: int = 0
    kv_offload_load_failures: int = 0


def add_stats(per_engine: list[SchedulerStats]) -> SchedulerStats:
    """Several engines' numbers added up (KV usage: their mean; per-position counts by
    position; adapter names: their union)."""
    total: dict = {}
    for f in fields(SchedulerStats):
        values = [getattr(s, f.name) for s in per_engine]
        if f.name.endswith("_lora_adapters"):
            total[f.name] = tuple(sorted({name for v in values for name in v}))
        elif isinstance(f.default, tuple):
            width = max((len(v) for v in values), default=0)
            total[f.name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
        else:
            total[f.name] = sum(values)
    total["kv_cache_usage"] /= max(len(per_engine), 1)
    return SchedulerStats(**total)


@dataclass(frozen=True)
class EngineCoreOutputs:
    """One step's outputs for one client."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
