"""Admission: whether a new request can ever be served, whether the queue takes more,
and where it waits (FCFS or priority order)."""

from __future__ import annotations

from collections import deque

from services.common.config import SchedulerConfig
from services.common.engine_errors import EngineOverloadedError
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request


class RequestRejectedError(ValueError):
    """A request that can never be served; the message says why."""


def validate_request(
    request: Request, known: dict, config: SchedulerConfig, kv: KVCacheManager
) -> None:
    """Raise RequestRejectedError naming the problem (`known`: ids already in use)."""
    num_prompt = request.num_prompt_tokens
    if request.request_id in known:
        raise RequestRejectedError(f"request_id {request.request_id!r} is already in use.")
    if num_prompt == 0:
        raise RequestRejectedError("the prompt is empty; give at least one token.")
    if num_prompt > config.max_model_len:
        raise RequestRejectedError(
            f"the prompt has {num_prompt} tokens, more than max_model_len ({config.max_model_len})."
        )
    needed = kv.peak_blocks(num_prompt)
    if needed > kv.num_blocks:
        raise RequestRejectedError(
            f"the prompt has {num_prompt} tokens and needs {needed} KV-cache blocks, "
            f"but the whole cache holds {kv.num_blocks} blocks of {kv.block_size}."
        )
    if request.num_sequences > config.max_num_seqs:
        raise RequestRejectedError(
            f"n={request.num_sequences} exceeds max_num_seqs ({config.max_num_seqs})."
        )


def check_overload(num_waiting: int, bound: int) -> None:
    """Refuse new work once `bound` requests wait (0: no bound); admitted requests,
    preempted ones included, are never refused."""
    if bound and num_waiting >= bound:
        raise EngineOverloadedError(
            f"the engine is overloaded: {num_waiting} requests are waiting "
            f"(max_waiting_requests={bound}); try again later."
        )


def enqueue_waiting(waiting: deque[Request], request: Request, policy: str) -> None:
    """FCFS appends; priority inserts before the first request that ranks after it."""
    if policy != "priority":
        waiting.append(request)
        return
    key = (request.priority, request.arrival_time)
    index = next(
        (i for i, r in enumerate(waiting) if (r.priority, r.arrival_time) > key), len(waiting)
    )
    waiting.insert(index, request)
