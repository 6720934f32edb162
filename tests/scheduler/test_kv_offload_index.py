"""KvOffloadIndex: the tiers' LRU bounds, write-through adds, drops and the restart fill."""

import pytest

from services.scheduler.kv_offload_index import KvOffloadIndex, LruKeys, blocks_within


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_lru_evicts_the_least_recently_used():
    lru = LruKeys(2)
    assert lru.add(key(1)) == [] and lru.add(key(2)) == []
    lru.touch(key(1))
    assert lru.add(key(3)) == [key(2)]
    assert list(lru) == [key(1), key(3)]
    assert lru.discard(key(1)) and not lru.discard(key(1))
    with pytest.raises(ValueError, match="capacity"):
        LruKeys(-1)


def test_saves_are_write_through_and_evictions_become_drops():
    index = KvOffloadIndex(host_blocks=1, disk_blocks=3)
    for i in range(4):
        index.add(key(i))
    assert index.tiers_of(key(3)) == ("host", "disk")
    assert index.tiers_of(key(2)) == ("disk",) and key(0) not in index
    assert index.take_drops() == [
        (key(0), "host"),
        (key(1), "host"),
        (key(2), "host"),
        (key(0), "disk"),
    ]
    assert index.take_drops() == []


def test_a_key_added_back_cancels_its_pending_drop():
    index = KvOffloadIndex(host_blocks=0, disk_blocks=1)
    index.add(key(1))
    index.add(key(2))  # key 1's drop is pending
    index.add(key(1))  # back before the drop went out: it must not delete the new save
    assert index.take_drops() == [(key(2), "disk")]
    assert key(1) in index and key(2) not in index


def test_a_hit_refreshes_and_forget_drops_everywhere():
    index = KvOffloadIndex(host_blocks=2, disk_blocks=2)
    index.add(key(1))
    index.add(key(2))
    index.hit(key(1))
    index.add(key(3))  # key 2 is the least recently used now
    assert key(1) in index and key(2) not in index
    index.take_drops()
    index.forget(key(1))
    assert key(1) not in index
    assert index.take_drops() == [(key(1), "host"), (key(1), "disk")]
    index.forget(key(9))  # unknown: nothing to drop
    assert index.take_drops() == []


def test_restart_fill_keeps_the_newest_within_the_bound():
    index = KvOffloadIndex(host_blocks=4, disk_blocks=2)
    found = [(key(1), 100, 30.0), (key(2), 100, 10.0), (key(3), 100, 20.0), (b"short", 1, 5.0)]
    assert index.fill_disk(found) == 2
    assert index.tiers_of(key(1)) == ("disk",) and index.tiers_of(key(3)) == ("disk",)
    assert index.take_drops() == [(key(2), "disk")]  # the oldest file, past the bound
    assert KvOffloadIndex(host_blocks=4, disk_blocks=0).fill_disk(found) == 0


def test_tiers_without_room_are_off():
    assert not KvOffloadIndex(0, 0).enabled
    assert blocks_within(10, 3) == 3 and blocks_within(2, 3) == 0
    with pytest.raises(ValueError, match="bytes_per_block"):
        blocks_within(10, 0)
