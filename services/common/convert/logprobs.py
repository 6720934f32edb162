"""Logprobs <-> logprobs.proto's Logprobs: one request's positions, each a TokenLogprobs
or None (0 entries: the first prompt position).

pack_logprobs / unpack_logprobs keep the older column form (`num_{p}logprob_positions`,
... with `p` "" or "prompt_") for StepResult until it carries Logprobs messages.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.proto.pagestream.internal.v1 import logprobs_pb2
from services.common.runner_output import TokenLogprobs

Positions = list[TokenLogprobs | None]


def logprobs_to_pb(positions: Positions) -> logprobs_pb2.Logprobs:
    num_entries, token_ids, values, ranks = [], [], [], []
    for position in positions:
        if position is None:
            num_entries.append(0)
            continue
        num_entries.append(len(position.token_ids))
        token_ids += position.token_ids
        values += position.logprobs
        ranks += position.ranks
    return logprobs_pb2.Logprobs(
        num_entries=num_entries, token_ids=token_ids, logprobs=values, ranks=ranks
    )


def logprobs_from_pb(message: logprobs_pb2.Logprobs) -> Positions:
    """Raises ValueError when the entries' lists differ in length from num_entries."""
    token_ids, values, ranks = list(message.token_ids), list(message.logprobs), list(message.ranks)
    if not len(token_ids) == len(values) == len(ranks) == sum(message.num_entries):
        raise ValueError("Logprobs' token_ids, logprobs and ranks differ from num_entries")
    positions: Positions = []
    start = 0
    for size in message.num_entries:
        if size < 0:
            raise ValueError("Logprobs.num_entries must not be negative")
        end = start + size
        positions.append(
            TokenLogprobs(token_ids[start:end], values[start:end], ranks[start:end])
            if size
            else None
        )
        start = end
    return positions


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
