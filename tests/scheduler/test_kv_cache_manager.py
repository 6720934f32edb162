"""Block pool, prefix caching, copy-on-write and swapping (behaviours 1, 2, 7, 9)."""

import pytest

from services.common.block_hash import hash_block_tokens, hash_request_tokens
from services.scheduler.block_pool import BlockPool
from services.scheduler.kv_cache_manager import NULL_BLOCK, KVCacheManager
from tests.scheduler.stand_in_worker import make_request


def _admit(kv: KVCacheManager, request, num_new=None):
    """Admit with a prefix hit; (hit tokens, group 0's new blocks)."""
    blocks, num_hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit if num_new is None else num_new
    new = kv.allocate_slots(request, num_new, blocks)
    assert new is not None
    request.num_computed_tokens = num_hit + num_new
    return num_hit, new[0]


def _ids(kv: KVCacheManager, rid: str) -> list[int]:
    """Group 0's block ids (the one group of a plain manager)."""
    return kv.block_table(rid)[0]


def test_hash_is_chained_sha256_and_salted():
    a = hash_block_tokens(None, [1, 2, 3])
    assert len(a) == 32
    assert hash_block_tokens(None, [1, 2, 3]) == a
    assert hash_block_tokens(None, [1, 2, 4]) != a
    assert hash_block_tokens(a, [1, 2, 3]) != a  # the parent is part of the key
    assert hash_block_tokens(None, [1, 2, 3], ("salt",)) != a
    tokens = list(range(40))
    plain = hash_request_tokens(tokens, 16)
    salted = hash_request_tokens(tokens, 16, cache_salt="tenant-a")
    assert len(plain) == 2  # full blocks only
    assert plain[0] != salted[0] and plain[1] != salted[1]  # the salt flows down the chain
    assert hash_request_tokens(tokens, 16, plain[:1]) == plain


def test_shared_prefix_hits_48_tokens_and_allocates_one_block():
    kv = KVCacheManager(block_size=16, num_blocks=10)
    first = make_request("a", list(range(55)))
    num_hit, blocks = _admit(kv, first)
    assert num_hit == 0 and len(blocks) == 4
    second = make_request("b", [*list(range(48)), 900, 901, 902, 903, 904])
    num_hit, new = _admit(kv, second)
    assert num_hit == 48
    assert len(new) == 1
    assert _ids(kv, "b")[:3] == _ids(kv, "a")[:3]
    assert kv.num_free_blocks == 10 - 5


def test_block_aligned_fully_cached_prompt_hits_all_but_last_block():
    kv = KVCacheManager(block_size=16, num_blocks=10)
    _admit(kv, make_request("a", list(range(32))))
    num_hit, new = _admit(kv, make_request("b", list(range(32))))
    assert num_hit == 16  # the hit never covers the last token
    assert len(new) == 1


def test_allocate_slots_returns_none_without_side_effects():
    kv = KVCacheManager(block_size=16, num_blocks=4)
    _admit(kv, make_request("a", list(range(40))))  # 3 blocks
    before = (kv.num_free_blocks, dict(kv.req_to_blocks), [b.ref_cnt for b in kv.pool.blocks])
    request = make_request("b", list(range(40)))
    _blocks, num_hit = kv.get_computed_blocks(request)
    assert num_hit == 32
    assert kv.allocate_slots(request, 40) is None
    after = (kv.num_free_blocks, dict(kv.req_to_blocks), [b.ref_cnt for b in kv.pool.blocks])
    assert before == after


def test_lru_eviction_tail_of_chain_first():
    kv = KVCacheManager(block_size=4, num_blocks=6)
    old = make_request("old", [1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)  # 2 full + 1 partial
    _admit(kv, old)
    old_ids = _ids(kv, "old")
    kv.free(old)
    newer = make_request("newer", [50, 51, 52, 53, 54], block_size=4)
    _admit(kv, newer)
    kv.free(newer)
    # Free queue: the never-used block, then old's chain tail-first, then newer's.
    order = [b.block_id for b in kv.pool.free_queue]
    assert order.index(old_ids[2]) < order.index(old_ids[1]) < order.index(old_ids[0])
    # Still hittable after finishing:
    again = make_request("again", [1, 2, 3, 4, 5, 6, 7, 8, 100], block_size=4)
    assert kv.get_computed_blocks(again)[1] == 8
    # Allocate until the old chain's tail is evicted: its head survives longer.
    filler = make_request("filler", list(range(200, 212)), block_size=4)  # 3 blocks
    _admit(kv, filler)
    # It took the unused block, old's partial block, then old's chain tail: the head stays.
    assert set(_ids(kv, "filler")) == {5, old_ids[2], old_ids[1]}
    assert kv.pool.get_cached_block(old.block_hashes[1]) is None
    assert kv.pool.get_cached_block(old.block_hashes[0]) is kv.pool.blocks[old_ids[0]]
    assert kv.get_computed_blocks(again)[1] == 4
    assert kv.pool.num_evictions == 1


def test_fork_shares_blocks_and_copy_on_write_on_partial_block():
    kv = KVCacheManager(block_size=16, num_blocks=20)
    parent = make_request("p", list(range(40)))
    _admit(kv, parent, num_new=39)
    children = [make_request(f"p#{i}", list(range(40))) for i in range(1, 4)]
    for child in children:
        child.num_computed_tokens = 39
        kv.fork(parent, child)
    table = _ids(kv, "p")
    assert len(table) == 3
    assert all(kv.pool.blocks[b].ref_cnt == 4 for b in table)
    new = kv.allocate_slots(children[0], 1)
    assert new == [[]]
    copies = kv.take_pending_copies()
    assert len(copies) == 1 and copies[0][0] == table[2]
    assert _ids(kv, "p#1")[:2] == table[:2]
    assert _ids(kv, "p#1")[2] == copies[0][1]
    assert kv.pool.blocks[table[2]].ref_cnt == 3
    assert kv.take_rewritten("p#1") and not kv.take_rewritten("p#1")  # the table goes once
    for seq in [children[1], children[2], parent]:
        kv.allocate_slots(seq, 1)
    # The last holder writes in place: three copies for four sequences.
    assert len(kv.take_pending_copies()) == 2
    assert _ids(kv, "p")[2] == table[2]


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(block_size=16, num_blocks=8, num_cpu_blocks=4)
    request = make_request("a", list(range(40)))
    _admit(kv, request)
    device_ids = _ids(kv, "a")
    out = kv.swap_out(request)
    assert [d for d, _ in out] == device_ids
    assert kv.num_free_blocks == 8 and len(kv.cpu_free) == 1
    back = kv.swap_in(request, 1)
    assert [c for c, _ in back] == [c for _, c in out]
    assert len(_ids(kv, "a")) == 3
    assert len(kv.cpu_free) == 4
    kv.free(request)
    assert kv.num_free_blocks == 8


def test_free_queue_operations_are_consistent():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2
    pool.free_blocks(reversed(blocks))
    assert [b.block_id for b in pool.free_queue] == [3, 4, 2, 1, 0]
    pool.touch([pool.blocks[1]])
    assert [b.block_id for b in pool.free_queue] == [3, 4, 2, 0]
    assert pool.blocks[1].ref_cnt == 1


def _window_kv(**kwargs) -> KVCacheManager:
    """Blocks of 4 under a 6-token window, chunks of 4: a sequence peaks at 4 blocks."""
    return KVCacheManager(4, 16, group_windows=(6,), max_step_tokens=4, **kwargs)


def _grow(kv: KVCacheManager, request, tokens: int) -> None:
    """Prefill / decode `tokens` more tokens, one chunk of at most 4 at a time."""
    while tokens:
        step = min(4, tokens)
        assert kv.allocate_slots(request, step) is not None
        request.num_computed_tokens += step
        tokens -= step


def test_a_sliding_window_frees_the_blocks_behind_it():
    kv = _window_kv()
    assert kv.peak_blocks(10**6) == 4 and kv.peak_blocks(8) == 2 and kv.holds_any_length
    request = make_request("w", list(range(40)), block_size=4)
    _grow(kv, request, 40)
    table = _ids(kv, "w")
    assert len(table) == 10 and kv.num_held_blocks("w") <= 4
    # the next query at 40 sees 35..40: blocks 0..7 (tokens 0..31) are behind the window
    assert kv.num_nulled["w"] == (40 - 4 - 6 + 1) // 4 == 7
    assert kv.take_rewritten("w")  # the worker gets the table whole
    assert kv.num_free_blocks == 16 - kv.num_held_blocks("w")
    kv.free(request)
    assert kv.num_free_blocks == 16 and not kv.num_nulled


def test_freed_window_blocks_stay_cached_for_a_prefix_hit():
    kv = _window_kv()
    first = make_request("a", list(range(40)), block_size=4)
    _grow(kv, first, 40)
    kv.free(first)
    second = make_request("b", list(range(40)), block_size=4)
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 36  # every full block but the last token's, from the start
    assert kv.allocate_slots(second, 40 - hit, blocks) is not None
    second.num_computed_tokens = 40
    assert kv.num_held_blocks("b") <= 4  # the hit's early blocks freed again at once


def test_fork_and_swap_keep_the_freed_entries():
    kv = _window_kv(num_cpu_blocks=8)
    parent = make_request("p", list(range(30)), block_size=4)
    _grow(kv, parent, 30)
    child = make_request("p#1", list(range(30)), block_size=4)
    child.num_computed_tokens = 30
    kv.fork(parent, child)
    assert _ids(kv, "p#1") == _ids(kv, "p")
    assert kv.num_nulled["p#1"] == kv.num_nulled["p"] > 0
    table = _ids(kv, "p")
    out = kv.swap_out(parent)
    assert len(out) == kv.num_held_blocks("p#1")  # only the held blocks move
    back = kv.swap_in(parent, 1)
    assert len(back) == len(out)
    restored = _ids(kv, "p")
    nulled = kv.num_nulled["p"]
    assert restored[:nulled] == [0] * nulled and len(restored) >= len(table)
    for request in (parent, child):
        kv.free(request)
    assert kv.num_free_blocks == 16 and len(kv.cpu_free) == 8


def _hybrid_kv(**kwargs) -> KVCacheManager:
    """One full-attention group beside two windowed ones (6 tokens), blocks of 4, chunks
    of 4: a table holds 3 entries a block position."""
    return KVCacheManager(4, 40, group_windows=(0, 6, 6), max_step_tokens=4, **kwargs)


def _entries(kv: KVCacheManager, rid: str, group: int) -> list[int]:
    """Group `group`'s block ids, a freed entry as None."""
    return [None if b is NULL_BLOCK else b.block_id for b in kv.req_to_blocks[rid][group]]


def test_hybrid_groups_free_only_the_windowed_entries():
    kv = _hybrid_kv()
    # the full group holds every block, each windowed group its window and a chunk
    assert kv.peak_blocks(40) == 10 + 2 * 4 and not kv.holds_any_length
    assert kv.longest_sequence() == (40 - 2 * 4) * 4  # 32 positions of the full group
    request = make_request("h", list(range(40)), block_size=4)
    _grow(kv, request, 40)
    table = kv.block_table("h")
    assert len(table) == 3 and all(len(ids) == 10 for ids in table)
    full, *windowed = (_entries(kv, "h", g) for g in range(3))
    assert None not in full and len(set(full)) == 10  # nothing of the full group is freed
    for entries in windowed:
        assert entries[:7] == [None] * 7 and None not in entries[7:]
    assert kv.num_held_blocks("h") == 10 + 2 * 3 <= kv.peak_blocks(40)
    assert kv.num_free_blocks == 40 - kv.num_held_blocks("h")
    kv.free(request)
    assert kv.num_free_blocks == 40 and not kv.num_nulled


def test_hybrid_prefix_hit_takes_the_full_groups_blocks_and_the_window():
    kv = _hybrid_kv()
    first = make_request("a", list(range(40)), block_size=4)
    _grow(kv, first, 40)
    full_blocks = _entries(kv, "a", 0)
    kv.free(first)
    second = make_request("b", [*range(40), 99], block_size=4)
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 40
    ids = [[None if b is NULL_BLOCK else b.block_id for b in group] for group in blocks]
    assert ids[0] == full_blocks  # the full group's chain, whole
    first_seen = (40 - 6 + 1) // 4  # the window of the first new token (position 40)
    for group in (1, 2):
        entries = ids[group]
        assert entries[:first_seen] == [None] * first_seen and None not in entries[first_seen:]
    assert kv.allocate_slots(second, 1, blocks) is not None
    assert [len(ids) for ids in kv.block_table("b")] == [11] * 3


def test_hybrid_hit_stops_where_a_windowed_group_lost_its_window():
    """Evicting a windowed group's block inside the window of the longest hit shortens
    the hit to where every group still has what its layers read."""
    kv = _hybrid_kv()
    first = make_request("a", list(range(40)), block_size=4)
    _grow(kv, first, 40)
    last_windowed = kv.req_to_blocks["a"][1][9]  # group 1's block at position 9
    kv.free(first)
    kv.pool.uncache(last_windowed)
    blocks, hit = kv.get_computed_blocks(make_request("b", list(range(44)), block_size=4))
    assert hit == 36  # positions 0..8: group 1's window of position 36 is 31..35, cached
    assert [len(group) for group in blocks] == [9] * 3


def test_hybrid_copy_on_write_fork_and_swap_per_entry():
    kv = _hybrid_kv(num_cpu_blocks=40)
    parent = make_request("p", list(range(30)), block_size=4)
    _grow(kv, parent, 30)
    child = make_request("p#1", list(range(30)), block_size=4)
    child.num_computed_tokens = 30
    kv.fork(parent, child)
    assert kv.block_table("p#1") == kv.block_table("p")
    # the child's next token lands in the shared, partly filled position 7: every group's
    # entry there is copied
    assert kv.allocate_slots(child, 1) is not None
    copies = kv.take_pending_copies()
    assert len(copies) == 3
    shared = [ids[7] for ids in kv.block_table("p")]
    assert sorted(src for src, _ in copies) == sorted(shared)
    held = kv.num_held_blocks("p")
    out = kv.swap_out(parent)
    assert len(out) == held
    back = kv.swap_in(parent, 1)
    assert len(back) == held
    assert _entries(kv, "p", 1)[: kv.num_nulled["p"]] == [None] * kv.num_nulled["p"]
    for request in (parent, child):
        kv.free(request)
    assert kv.num_free_blocks == 40 and len(kv.cpu_free) == 40


def test_kv_cache_groups_must_share_one_window():
    with pytest.raises(ValueError, match="one window"):
        KVCacheManager(4, 8, group_windows=(0, 4, 8))
