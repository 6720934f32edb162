"""The prefix-cache events a BlockPool records mirror its hash index exactly: a router
that applies every drained batch in order holds the same hashes as the pool."""

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.block_hash import hash_block_tokens
from services.common.kv_events import KvEventBatch, KvEventLog
from services.scheduler.block_pool import BlockPool
from services.scheduler.kv_event_publisher import MAX_BACKLOG, KvEventPublisher

HASHES = [hash_block_tokens(None, [i]) for i in range(6)]

op = st.one_of(
    st.tuples(st.just("alloc"), st.integers(1, 3)),
    st.tuples(st.just("cache"), st.integers(0, 7), st.integers(0, 5)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("touch"), st.integers(0, 7)),
    st.tuples(st.just("reset")),
    st.tuples(st.just("drain")),
)


def _apply(pool: BlockPool, used: list, step) -> None:
    kind = step[0]
    if kind == "alloc" and pool.num_free_blocks >= step[1]:
        used.extend(pool.get_new_blocks(step[1]))
    elif kind == "cache" and used:
        pool.cache_full_block(used[step[1] % len(used)], HASHES[step[2]])
    elif kind == "free" and used:
        pool.free_blocks([used.pop(step[1] % len(used))])
    elif kind == "touch" and step[1] < pool.num_blocks:
        block = pool.blocks[step[1]]
        if block.block_hash is not None and block.ref_cnt == 0:
            pool.touch([block])
            used.append(block)
    elif kind == "reset":
        pool.reset_prefix_cache()


@settings(max_examples=200, deadline=None)
@given(st.lists(op, max_size=60))
def test_applying_the_drained_batches_gives_the_pools_index(ops):
    pool = BlockPool(8)
    pool.events = KvEventLog()
    seen: set[bytes] = set()
    used: list = []
    for step in ops:
        if step[0] == "drain":
            pool.events.drain().apply_to(seen)
            assert seen == set(pool.cached_block_hash_to_block)
        else:
            _apply(pool, used, step)
    batch = pool.events.drain()
    assert not set(batch.stored) & set(batch.removed)
    batch.apply_to(seen)
    assert seen == set(pool.cached_block_hash_to_block)
    assert not pool.events  # drained


def test_a_pool_without_listeners_records_nothing():
    pool = BlockPool(4)
    block = pool.get_new_blocks(1)[0]
    pool.cache_full_block(block, HASHES[0])
    assert pool.events is None and pool.get_cached_block(HASHES[0]) is block


class _Kv:
    def __init__(self, pool):
        self.pool, self.enable_caching, self.usage = pool, True, 0.0
        self.offload = None  # no KV offload tiers


class _Scheduler:
    """What the publisher reads of a scheduler: its pool, block size and stats."""

    block_size = 16

    def __init__(self, num_blocks: int = 8):
        self.kv = _Kv(BlockPool(num_blocks))
        self.running = 0

    def get_stats(self):
        from services.common.engine_output import SchedulerStats

        return SchedulerStats(num_running_reqs=self.running)


async def test_subscribers_get_a_snapshot_then_changes_and_start_over_on_attach():
    scheduler = _Scheduler()
    pool = scheduler.kv.pool
    first = pool.get_new_blocks(1)[0]
    pool.cache_full_block(first, HASHES[0])  # cached before anyone listens
    publisher = KvEventPublisher(scheduler)
    queue = publisher.subscribe()
    snapshot: KvEventBatch = queue.get_nowait()
    assert snapshot.reset and snapshot.stored == [HASHES[0]] and snapshot.block_size == 16

    second = pool.get_new_blocks(1)[0]
    pool.cache_full_block(second, HASHES[1])
    publisher.publish()
    change = queue.get_nowait()
    assert not change.reset and change.stored == [HASHES[1]] and change.removed == []
    publisher.publish()  # nothing moved: nothing sent
    assert queue.empty()
    scheduler.running = 3
    publisher.publish()  # the load moved: a batch with the new stats
    assert queue.get_nowait().stats.num_running_reqs == 3

    rebuilt = _Scheduler()  # the engine core was rebuilt: an empty cache
    publisher.attach(rebuilt)
    fresh = queue.get_nowait()
    assert fresh.reset and fresh.stored == [] and rebuilt.kv.pool.events is not None

    publisher.unsubscribe(queue)
    assert rebuilt.kv.pool.events is None  # nobody listens: no recording
    publisher.close()


async def test_a_subscriber_that_falls_behind_gets_a_snapshot_instead_of_the_backlog():
    scheduler = _Scheduler(num_blocks=MAX_BACKLOG + 8)
    publisher = KvEventPublisher(scheduler)
    queue = publisher.subscribe()
    pool = scheduler.kv.pool
    for i in range(MAX_BACKLOG + 2):
        block = pool.get_new_blocks(1)[0]
        pool.cache_full_block(block, hash_block_tokens(None, [1000 + i]))
        publisher.publish()
    assert queue.qsize() <= MAX_BACKLOG
    seen: set[bytes] = set()
    while not queue.empty():
        queue.get_nowait().apply_to(seen)
    assert seen == set(pool.cached_block_hash_to_block)
    publisher.close()
    assert await asyncio.wait_for(queue.get(), 1) is None  # the end
