"""Hostile inputs against the engine side: a long prompt's prompt logprobs stay within the
profiled logits, a cancelled add never leaves a request running unread, grammars that
blow up fail fast, and KV events go only to authenticated internal peers."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from services.common.rank_info import RankInfo
from services.worker.model_runner import ModelRunner
from services.worker.sampler import compute_token_logprobs
from services.worker.step_inputs import PromptLogprobsInputs

VOCAB = 97


class _LogitsRecorder:
    """Stands in for a CausalLM: a fixed projection to the vocabulary, recording how many
    rows each compute_logits call got."""

    def __init__(self) -> None:
        self.weight = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))
        self.rows_seen: list[int] = []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.rows_seen.append(hidden.shape[0])
        return hidden @ self.weight  # [rows, vocab]


def _spec(num_rows: list[int], ks: list[int]) -> PromptLogprobsInputs:
    total = sum(num_rows)
    return PromptLogprobsInputs(
        request_ids=[f"r{i}" for i in range(len(num_rows))],
        num_rows=num_rows,
        first_positions=[1] * len(num_rows),
        num_logprobs=ks,
        token_indices=torch.arange(total, dtype=torch.int64),
        target_ids=torch.arange(total, dtype=torch.int64) % VOCAB,
    )


def test_prompt_logprobs_of_a_long_chunk_are_computed_in_bounded_slices() -> None:
    """A prefill chunk of prompt-logprob rows never turns into [chunk, vocab] float32 logits
    at once: at most max_num_seqs rows (what the memory profile counted) at a time."""
    model = _LogitsRecorder()
    runner = ModelRunner(model, None, SimpleNamespace(max_num_seqs=4), None, RankInfo())
    hidden = torch.randn(11, 8, generator=torch.Generator().manual_seed(1))  # [tokens, hidden]
    spec = _spec([7, 4], [2, 0])

    result = runner._prompt_logprobs(hidden, spec)

    assert model.rows_seen and max(model.rows_seen) <= 4
    full = compute_token_logprobs(hidden @ model.weight, spec.target_ids, 2)
    first = result["r0"][1:]  # position 0 has no logprob
    assert [e.token_ids for e in first] == full.token_ids[:7, :3].tolist()
    assert [e.ranks for e in result["r1"][1:]] == full.ranks[7:, :1].tolist()
    torch.testing.assert_close(torch.tensor([e.logprobs for e in first]), full.logprobs[:7, :3])
