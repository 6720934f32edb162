"""Logprobs <-> logprobs.proto's Logprobs: one request's positions, each a TokenLogprobs
or None (0 entries: the first prompt position). EngineOutput and StepResult carry it for
sampled and prompt tokens alike.
"""

from __future__ import annotations

from services.common.proto.pagestream.internal.v1 import logprobs_pb2
from services.common.runner_output import TokenLogprobs

Positions = list[TokenLogprobs | None]


def fill_logprobs(message: logprobs_pb2.Logprobs, positions: Positions) -> None:
    """Append `positions` to `message` (a field or map entry of the message being built,
    which saves the copy a finished Logprobs would cost)."""
    num_entries = message.num_entries
    token_ids, values, ranks = message.token_ids, message.logprobs, message.ranks
    for position in positions:
        if position is None:
            num_entries.append(0)
            continue
        num_entries.append(len(position.token_ids))
        token_ids.extend(position.token_ids)
        values.extend(position.logprobs)
        ranks.extend(position.ranks)


def logprobs_to_pb(positions: Positions) -> logprobs_pb2.Logprobs:
    message = logprobs_pb2.Logprobs()
    fill_logprobs(message, positions)
    return message


def logprobs_from_pb(message: logprobs_pb2.Logprobs) -> Positions:
    """Raises ValueError when the entries' lists differ in length from num_entries."""
    num_entries = message.num_entries
    token_ids, values, ranks = message.token_ids, message.logprobs, message.ranks
    if not len(token_ids) == len(values) == len(ranks) == sum(num_entries):
        raise ValueError("Logprobs' token_ids, logprobs and ranks differ from num_entries")
    positions: Positions = []
    start = 0
    for size in num_entries:
        if size < 0:
            raise ValueError("Logprobs.num_entries must not be negative")
        end = start + size  # slices of the repeated fields are lists
        positions.append(
            TokenLogprobs(token_ids[start:end], values[start:end], ranks[start:end])
            if size
            else None
        )
        start = end
    return positions
