"""Logprobs <-> logprobs.proto's Logprobs: one request's positions, each a TokenLogprobs
or None (0 entries: the first prompt position). EngineOutput and StepResult carry it for
sampled and prompt tokens alike.
"""

from __future__ import annotations

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
