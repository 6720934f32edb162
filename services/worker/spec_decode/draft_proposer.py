"""DraftModelProposer: a smaller model of the same vocabulary proposes k tokens greedily.

The draft runs on the target's worker with its own KV cache, laid out in the target's
block tables (same block ids, its own layer shapes), so prefix hits, swaps and
copy-on-write move its blocks with the target's.
"""

from __future__ import annotations

import numpy as np
import torch

from services.common.scheduler_output import SchedulerOutput
from services.common.speculative_config import SpeculativeConfig
from services.worker.cache_engine import CacheEngine
from services.worker.input_batch import InputBatch
from services.worker.models.causal_lm import CausalLM
from services.worker.spec_decode.proposer import room_for_proposals


class DraftModelProposer:
    """After each target step the draft first catches up: it runs every scheduled sequence
    over the positions the target computed this step, from the step's num_computed_tokens
    to the sequence's last known token (the accepted proposals and the new token included),
    so its cache holds what the target's holds (it recomputes the positions rejected
    proposals wrote, like the target). The logits of a proposing sequence's last token give
    the first proposal; k - 1 single-token steps give the rest. Positions past a sequence's
    KV slots (the scheduler keeps k lookahead slots) or max_model_len are never written:
    such a sequence gets fewer proposals.
    """

    def __init__(self, config: SpeculativeConfig, model: CausalLM, cache_engine: CacheEngine):
        self.config = config
        self.model = model
        self.cache_engine = cache_engine

    @torch.inference_mode()
    def propose(
        self, batch: InputBatch, plan: SchedulerOutput, request_ids: list[str]
    ) -> dict[str, list[int]]:
        scheduled = list(plan.num_scheduled_tokens)
        if not scheduled:
            return {}
        start, num_tokens, num_slots = batch.positions(scheduled)
        counts = np.fromiter(plan.num_scheduled_tokens.values(), np.int64, len(scheduled))
        # up to the last known token (+1 past a prefill chunk: its next prompt token)
        end = np.minimum(np.minimum(num_tokens, start + counts + 1), num_slots)  # [S]
        caught_up = dict(zip(scheduled, (end == num_tokens).tolist(), strict=True))
        proposing = [rid for rid in request_ids if caught_up.get(rid)]
        first = self._forward(batch, scheduled, start, end - start, proposing)
        drafts = {rid: [token] for rid, token in zip(proposing, first, strict=True)}
        return self._continue(batch, drafts)

    def _continue(self, batch: InputBatch, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """Single-token steps, each feeding the latest proposal, until k (or no room)."""
        for _ in range(self.config.num_speculative_tokens - 1):
            ids = list(drafts)
            _, num_tokens, num_slots = batch.positions(ids)
            made = np.array([len(drafts[rid]) for rid in ids], np.int64)
            rooms = [
                room_for_proposals(batch, rid, self.config.num_speculative_tokens) for rid in ids
            ]
            position = num_tokens + made - 1  # where the latest proposal goes  [P]
            growing = (made < np.array(rooms, np.int64)) & (position < num_slots)
            ids = [rid for rid, grows in zip(ids, growing.tolist(), strict=True) if grows]
            if not ids:
                break
            position = position[growing]
            batch.write_tokens(ids, position, [drafts[rid][-1] for rid in ids])
            ones = np.ones(len(ids), np.int64)
            for rid, token in zip(ids, self._forward(batch, ids, position, ones, ids), strict=True):
                drafts[rid].append(token)
        return {
            rid: tokens[: room_for_proposals(batch, rid, len(tokens))]
            for rid, tokens in drafts.items()
            if tokens
        }

    def _forward(
        self,
        batch: InputBatch,
        request_ids: list[str],
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        wanted: list[str],
    ) -> list[int]:
        """One draft forward over the given positions; the argmax after the last
        position of each of `wanted` (in its order)."""
        keep = num_scheduled > 0
        if not keep.all():
            request_ids = [rid for rid, k in zip(request_ids, keep.tolist(), strict=True) if k]
            num_computed, num_scheduled = num_computed[keep], num_scheduled[keep]
        if not request_ids:
            return []
        inputs = batch.forward_inputs(request_ids, num_computed, num_scheduled)
        kv_caches = self.cache_engine.kv_caches
        hidden = self.model(
            inputs.input_ids, inputs.positions, kv_caches, inputs.attention_metadata()
        )  # [T, hidden]
        if not wanted:
            return []
        row_of = {rid: row for row, rid in enumerate(request_ids)}
        rows = inputs.logits_indices[[row_of[rid] for rid in wanted]]  # [P]
        logits = self.model.compute_logits(hidden[rows])  # [P, vocab]
        return logits.argmax(dim=-1).tolist()
