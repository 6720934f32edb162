"""KV events announce the offload tiers: a router applying every batch holds exactly the
keys the tiers' index holds (beside the device's hashes), through a device-cache reset;
the DP router counts a prefix the tiers hold as a hit worth less than the device's."""

from services.common.convert.kv_events import kv_events_from_pb, kv_events_to_pb
from services.common.kv_events import KvEventBatch, KvEventLog
from services.frontend.prefix_index import OFFLOAD_WEIGHT, PrefixIndex
from services.frontend.router import Router, RouterConfig
from services.scheduler.kv_event_publisher import KvEventPublisher
from services.scheduler.kv_offload_index import KvOffloadIndex
from tests.helpers.scheduler_invariants import check_invariants
from tests.scheduler.offload_stand_in_worker import OffloadStandInWorker
from tests.scheduler.stand_in_worker import make_request

KEYS = [bytes([i]) * 32 for i in range(8)]


def test_the_log_records_keys_entering_and_leaving_every_tier():
    index = KvOffloadIndex(host_blocks=1, disk_blocks=2)
    index.events = log = KvEventLog()
    held: set[bytes] = set()
    for key in KEYS[:4]:
        index.add(key)
    index.forget(KEYS[3])
    log.drain().apply_offloaded_to(held)
    assert held == index.keys() == {KEYS[2]}
    assert index.fill_disk([(KEYS[5], 1, 1.0)]) == 2
    batch = log.drain()
    assert batch.stored_offloaded == [KEYS[5]] and batch.removed_offloaded == []


def test_a_router_follows_the_tiers_through_a_device_reset():
    from services.common.config import CacheConfig, SchedulerConfig
    from services.scheduler.scheduler import Scheduler

    scheduler = Scheduler(
        SchedulerConfig(max_model_len=256),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        num_device_blocks=24,
    )
    scheduler.kv.use_offload(KvOffloadIndex(host_blocks=2, disk_blocks=6))
    worker = OffloadStandInWorker(24, 4)
    publisher = KvEventPublisher(scheduler)
    queue = publisher.subscribe()
    router_view = PrefixIndex()
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", [50 * i + t for t in range(1, 11)], 4))
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        scheduler.update_from_output(plan, worker.execute(plan))
        publisher.publish()
        check_invariants(scheduler)
    assert scheduler.kv.reset_prefix_cache()
    publisher.publish()
    while not queue.empty():
        router_view.apply(kv_events_from_pb(kv_events_to_pb(queue.get_nowait())))
    assert router_view.confirmed == set() and len(scheduler.kv.offload.keys()) == 6
    assert router_view.offloaded == scheduler.kv.offload.keys()
    publisher.close()


class _Replica:
    def __init__(self, index: PrefixIndex) -> None:
        self.index, self.load, self.cached_blocks = index, 0, len(index)

    def matched_blocks(self, hashes) -> float:
        return self.index.match(hashes)


def test_the_router_weighs_tier_hits_below_device_hits():
    device, tiers, both = PrefixIndex(), PrefixIndex(), PrefixIndex()
    device.apply(KvEventBatch(stored=KEYS[:2]))
    tiers.apply(KvEventBatch(stored_offloaded=KEYS[:3]))
    both.apply(KvEventBatch(stored=KEYS[:2], stored_offloaded=KEYS[2:4]))
    assert device.match(KEYS[:4]) == 2
    assert tiers.match(KEYS[:4]) == 3 * OFFLOAD_WEIGHT
    assert both.match(KEYS[:4]) == 2 + 2 * OFFLOAD_WEIGHT
    both.apply(KvEventBatch(reset=True))
    assert both.match(KEYS[:4]) == 0
    replicas = [_Replica(device), _Replica(tiers), _Replica(PrefixIndex())]
    assert Router().choose(replicas, KEYS[:4]) == (replicas[0], "cache_hit")
    replicas = [_Replica(PrefixIndex()), _Replica(tiers)]  # 3 of 3 blocks, weighed 1.5
    assert Router(RouterConfig(cache_threshold=0.5)).choose(replicas, KEYS[:3]) == (
        replicas[1],
        "cache_hit",
    )
