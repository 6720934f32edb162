"""Logprob columns shared by StepResult and EngineOutputBatch.

Per item (a request, or an output), `num_{p}logprob_positions` positions; per position,
`num_{p}logprob_entries` entries of (token id, logprob, rank), all flattened. A position
with 0 entries is None (the first prompt position). `p` is "" or "prompt_".
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.runner_output import TokenLogprobs

Positions = list[TokenLogprobs | None]


def pack_logprobs(message, prefix: str, items: Iterable[Positions | None]) -> None:
    """Append each item's positions to the message's `prefix` logprob columns."""
    num_positions, num_entries = [], []
    token_ids, values, ranks = [], [], []
    for positions in items:
        num_positions.append(len(positions) if positions else 0)
        for position in positions or ():
            if position is None:
                num_entries.append(0)
                continue
            num_entries.append(len(position.token_ids))
            token_ids.extend(position.token_ids)
            values.extend(position.logprobs)
            ranks.extend(position.ranks)
    getattr(message, f"num_{prefix}logprob_positions").extend(num_positions)
    getattr(message, f"num_{prefix}logprob_entries").extend(num_entries)
    getattr(message, f"{prefix}logprob_token_ids").extend(token_ids)
    getattr(message, f"{prefix}logprob_values").extend(values)
    getattr(message, f"{prefix}logprob_ranks").extend(ranks)


def unpack_logprobs(message, prefix: str) -> list[Positions]:
    """One list of positions per item, in order (an item with none gives [])."""
    num_entries = list(getattr(message, f"num_{prefix}logprob_entries"))
    token_ids = list(getattr(message, f"{prefix}logprob_token_ids"))
    values = list(getattr(message, f"{prefix}logprob_values"))
    ranks = list(getattr(message, f"{prefix}logprob_ranks"))
    if not len(token_ids) == len(values) == len(ranks) == sum(num_entries):
        raise ValueError(f"{prefix}logprob columns differ in length")
    items: list[Positions] = []
    position = start = 0
    for count in getattr(message, f"num_{prefix}logprob_positions"):
        if position + count > len(num_entries):
            raise ValueError(f"num_{prefix}logprob_positions exceeds the entries given")
        positions: Positions = []
        for size in num_entries[position : position + count]:
            end = start + size
            positions.append(
                TokenLogprobs(token_ids[start:end], values[start:end], ranks[start:end])
                if size
                else None
            )
            start = end
        position += count
        items.append(positions)
    return items
