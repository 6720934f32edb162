"""Invariants the scheduler keeps after every step, checked by the scheduler tests: the
block manager's accounting, the plans in flight, and the speculative-decoding counters."""

from __future__ import annotations

import itertools
from collections import Counter

from services.scheduler.scheduler import Scheduler


def check_invariants(scheduler: Scheduler) -> None:
    """The block manager is consistent: every ref count equals its holders, the free queue
    holds exactly the unreferenced blocks, swapped CPU blocks are distinct and, with the
    free ones, all of them, and only live requests hold tables."""
    kv = scheduler.kv
    blocks = kv.pool.blocks
    assert all(b.ref_cnt >= 0 for b in blocks)
    used = sum(1 for b in blocks if b.ref_cnt > 0)
    assert used + kv.num_free_blocks == kv.num_blocks
    assert {id(b) for b in kv.pool.free_queue} == {id(b) for b in blocks if b.ref_cnt == 0}
    # A block in several tables is shared on purpose: its ref count says so exactly.
    tables = kv.req_to_blocks.values()
    holders = Counter(b.block_id for table in tables for group in table for b in group)
    for block in blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
    swapped_cpu = [c for table in kv.swapped.values() for ids in table for c in ids]
    assert len(swapped_cpu) == len(set(swapped_cpu))
    assert len(swapped_cpu) + len(kv.cpu_free) == kv.num_cpu_blocks
    live = {r.request_id for r in [*scheduler.running, *scheduler.waiting, *scheduler.swapped]}
    assert set(kv.req_to_blocks) <= live


def check_in_flight(scheduler: Scheduler) -> None:
    """Requests in flight are running, and the per-group counts say exactly which."""
    in_flight = [r for r in scheduler.requests.values() if r.in_flight]
    assert all(r in scheduler.running for r in in_flight)
    assert Counter(r.group_id for r in in_flight) == scheduler.in_flight.groups


def check_spec_decode_stats(scheduler: Scheduler) -> None:
    """The spec_decode_* counters add up: accepted <= drafted, and the per-position
    acceptances sum to the accepted count and never rise with the position."""
    stats = scheduler.get_stats()
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert 0 <= stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_drafts <= stats.spec_decode_num_draft_tokens
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert all(a >= b for a, b in itertools.pairwise(per_pos)), per_pos
    assert not per_pos or per_pos[0] <= stats.spec_decode_num_drafts
