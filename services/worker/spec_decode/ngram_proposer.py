"""NgramProposer: prompt-lookup proposals from a sequence's own token ids.

The sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min, the
longest match wins) are looked up in everything before them, prompt and output alike; the
tokens that followed the latest earlier occurrence are proposed, up to k of them. Text
that copies its input (edits, summaries, retrieval answers, JSON repeating keys) gets
long accepted runs; other text gets no match and costs nothing.
"""

from __future__ import annotations

import numpy as np

from services.common.scheduler_output import SchedulerOutput
from services.common.speculative_config import SpeculativeConfig
from services.worker.input_batch import InputBatch
from services.worker.spec_decode.proposer import room_for_proposals


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens following the latest earlier match of the longest suffix n-gram
    (min_n <= n <= max_n) of `tokens` [N]; [] without a match."""
    num_tokens = len(tokens)
    if num_tokens < min_n + 1 or k < 1:
        return []
    # ends of earlier n-grams: positions before the last that hold the last token
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # [C]
    if len(ends) == 0:
        return []
    match_len = np.ones(len(ends), np.int64)  # [C] matched suffix length so far
    alive = np.ones(len(ends), bool)
    for back in range(1, min(max_n, num_tokens - 1)):
        starts = ends - back
        alive &= starts >= 0
        alive[alive] &= tokens[starts[alive]] == tokens[-1 - back]
        if not alive.any():
            break
        match_len += alive
    best = int(match_len.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(match_len == best)[-1]])  # the latest of the longest
    return tokens[end + 1 : end + 1 + k].tolist()


class NgramProposer:
    cache_engine = None

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(
        self, batch: InputBatch, plan: SchedulerOutput, request_ids: list[str]
    ) -> dict[str, list[int]]:
        config = self.config
        proposals = {}
        for request_id in request_ids:
            k = room_for_proposals(batch, request_id, config.num_speculative_tokens)
            tokens = batch.token_row(request_id)
            drafts = propose_ngram(tokens, config.prompt_lookup_min, config.prompt_lookup_max, k)
            if drafts:
                proposals[request_id] = drafts
        return proposals
