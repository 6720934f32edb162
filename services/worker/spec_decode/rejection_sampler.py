"""Verification of speculative proposals: which of them the target keeps.

A request keeps its proposals up to the first mismatch with the target's own sampled
token, then the target's token there (the "bonus" token when every proposal is accepted):
the output distribution is the target's, and under greedy decoding the tokens are the
target's argmax chain (why: `accept_proposals`).
"""

from __future__ import annotations


def accept_proposals(
    target_ids: list[int],  # [L] the target's token at each verified position, row order
    request_ids: list[str],  # [R] the sampling requests, in row order
    draft_token_ids: dict[str, list[int]],  # the proposals of the requests that have some
) -> tuple[list[list[int]], list[int]]:
    """Per request: the tokens it keeps (accepted proposals, then the target's token) and
    its first row in target_ids. A request without proposals keeps its one token.

    The sampler draws the target's own token at every verified position of a request (row i
    sees the request's tokens plus proposals 1..i, with the request's own sampling
    parameters, penalties and seeded noise at that output position). Proposals here are
    deterministic (the n-gram's tokens, the draft model's argmax), so the draft distribution q
    is one-hot on the proposal d, and the standard rule (accept d with probability
    min(1, p(d) / q(d)) = p(d); on rejection draw from the residual max(p - q, 0), which is p
    without d, renormalised) is exactly: draw t from p, keep d if t == d, else emit t and
    stop.
    """
    kept: list[list[int]] = []
    first_rows: list[int] = []
    row = 0
    for request_id in request_ids:
        drafts = draft_token_ids.get(request_id, ())
        targets = target_ids[row : row + len(drafts) + 1]
        num_accepted = 0
        while num_accepted < len(drafts) and targets[num_accepted] == drafts[num_accepted]:
            num_accepted += 1
        kept.append(targets[: num_accepted + 1])
        first_rows.append(row)
        row += len(drafts) + 1
    assert row == len(target_ids), (row, len(target_ids))
    return kept, first_rows
