"""Proposer: what the model runner asks for speculative proposals after each step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from services.common.scheduler_output import SchedulerOutput
from services.common.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from services.worker.cache_engine import CacheEngine
    from services.worker.input_batch import InputBatch


class Proposer(Protocol):
    config: SpeculativeConfig
    # A draft model's own KV cache, in the target's block tables (None: no cache).
    cache_engine: CacheEngine | None

    def propose(
        self, batch: InputBatch, plan: SchedulerOutput, request_ids: list[str]
    ) -> dict[str, list[int]]:
        """Called after every step, once the sampled tokens are in `batch`: proposals to
        follow each of `request_ids` (a request may get none). `plan` is the step's."""
        ...


def room_for_proposals(batch: InputBatch, request_id: str, k: int) -> int:
    """How many proposals the request can take: k, fewer near max_model_len (its next
    step's tokens must all fit)."""
    return max(min(k, batch.max_model_len - len(batch.token_row(request_id)) - 1), 0)
