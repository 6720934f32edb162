"""SpecDecodeStats: the scheduler's running counts of speculative proposals and acceptances."""

from __future__ import annotations


class SpecDecodeStats:
    """Cumulative, as vLLM's spec_decode_* counters: `num_drafts` sequences had proposals
    verified, `num_draft_tokens` proposals in all, `num_accepted_tokens` of them accepted;
    `accepted_per_pos[i]` counts the drafts whose proposal at position i was accepted (so it
    never grows with i and its sum is num_accepted_tokens)."""

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_draft_tokens, (num_accepted, num_draft_tokens)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1
