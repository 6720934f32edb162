"""The scheduler over KV offload tiers, driven by the stand-in worker with a fake store:
write-through saves once per key, loads on a prefix hit after the device cache lost the
blocks, a failed load recomputed from scratch, and the index matching what the store holds."""

from services.common.config import CacheConfig, SchedulerConfig
from services.common.runner_output import RunnerOutput
from services.scheduler.kv_offload_index import KvOffloadIndex
from services.scheduler.scheduler import Scheduler
from tests.helpers.scheduler_invariants import check_invariants
from tests.scheduler.offload_stand_in_worker import OffloadStandInWorker
from tests.scheduler.stand_in_worker import make_request, reference_generate

BLOCK = 4
PROMPT = list(range(1, 23))  # 5 full blocks and 2 tokens


def build(num_blocks=64, host_blocks=16, disk_blocks=64, **config):
    config.setdefault("max_model_len", 256)
    scheduler = Scheduler(
        SchedulerConfig(**config),
        CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        num_device_blocks=num_blocks,
    )
    scheduler.kv.use_offload(KvOffloadIndex(host_blocks, disk_blocks))
    return scheduler, OffloadStandInWorker(num_blocks, BLOCK)


def run(scheduler, worker, requests, max_steps=500):
    """Serve `requests` to the end, checking the block manager after every step; the
    plans, and every request's tokens."""
    for request in requests:
        scheduler.add_request(request)
    plans, outputs = [], {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return plans, outputs
        plan = scheduler.schedule()
        plans.append(plan)
        for batch in scheduler.update_from_output(plan, worker.execute(plan)).values():
            for out in batch.outputs:
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        check_invariants(scheduler)
    raise AssertionError("the requests did not finish")


def request(rid, prompt=PROMPT, max_tokens=6):
    return make_request(rid, list(prompt), block_size=BLOCK, max_tokens=max_tokens)


def expected(prompt=PROMPT, max_tokens=6):
    return reference_generate(list(prompt), request("x", prompt, max_tokens).sampling_params, 256)


def test_saves_are_issued_once_per_key():
    scheduler, worker = build()
    first = request("a")
    plans, outputs = run(scheduler, worker, [first])
    saved = [key for plan in plans for _, key in plan.kv_saves]
    # every full block of the prompt and its outputs (27 tokens: 6 blocks), once each
    assert saved == first.block_hashes[:6] and len(set(saved)) == 6
    plans, outputs = run(scheduler, worker, [request("b")])  # a device hit: nothing new
    assert [key for plan in plans for _, key in plan.kv_saves] == []
    assert outputs["b"] == expected() and not any(plan.kv_loads for plan in plans)


def test_a_hit_past_the_device_cache_loads_from_the_tiers():
    scheduler, worker = build()
    run(scheduler, worker, [request("a")])
    assert scheduler.kv.reset_prefix_cache()  # the device cache forgets; the tiers keep
    again = request("b")
    plans, outputs = run(scheduler, worker, [again])
    # 21 tokens could hit (never the last); 5 full blocks do
    assert [key for key, _ in plans[0].kv_loads] == again.block_hashes[:5]
    assert plans[0].num_scheduled_tokens == {"b": 2}
    assert again.num_cached_tokens == 20 and worker.num_loads == 5
    assert outputs["b"] == expected()  # the stand-in read the loaded cells back
    stats = scheduler.get_stats()
    assert stats.prefix_cache_hits == 20 and stats.kv_offload_hits == 20
    # loaded blocks are in the device cache again: a third request hits the device
    plans, _ = run(scheduler, worker, [request("c")])
    assert not any(plan.kv_loads for plan in plans)


def test_the_index_follows_the_store_within_its_bounds():
    scheduler, worker = build(num_blocks=32, host_blocks=3, disk_blocks=8)
    prompts = [[100 * i + t for t in range(1, 14)] for i in range(1, 5)]
    run(scheduler, worker, [request(f"r{i}", p, 3) for i, p in enumerate(prompts)])
    worker.execute(scheduler.schedule())  # the last drops go out with the next plan
    tiers = scheduler.kv.offload.tiers
    assert len(tiers["host"]) == 3 and len(tiers["disk"]) == 8
    for name in ("host", "disk"):
        assert set(worker.tiers[name]) == set(tiers[name]), name


def test_a_failed_load_is_recomputed_from_scratch():
    scheduler, worker = build()
    first = request("a")
    run(scheduler, worker, [first])
    assert scheduler.kv.reset_prefix_cache()
    worker.corrupt(first.block_hashes[2])
    again = request("b")
    plans, outputs = run(scheduler, worker, [again])
    assert len(plans[0].kv_loads) == 5 and scheduler.num_preemptions == 1
    assert scheduler.get_stats().kv_offload_load_failures == 1
    assert outputs["b"] == expected()  # the garbage step's token was dropped
    # the rerun hits the two blocks before the failed one on the device, recomputes the rest
    assert plans[1].num_scheduled_tokens == {"b": 22 - 8}
    assert plans[1].kv_drops  # the failed key and the blocks computed after it
    assert first.block_hashes[2] in scheduler.kv.offload  # computed again, saved again


def test_a_device_hit_on_a_failed_load_in_flight_is_recomputed_too():
    """b loads; c, planned before b's step lands, hits b's loaded blocks on the device:
    both read garbage, both are recomputed."""
    scheduler, worker = build()
    first = request("a")
    run(scheduler, worker, [first])
    assert scheduler.kv.reset_prefix_cache()
    worker.corrupt(first.block_hashes[0])
    b, c = request("b"), request("c")
    scheduler.add_request(b)
    plan_b = scheduler.schedule()
    scheduler.add_request(c)
    plan_c = scheduler.schedule()  # b is in flight: c hits its blocks on the device
    assert plan_c.num_scheduled_tokens == {"c": 2} and not plan_c.kv_loads
    scheduler.update_from_output(plan_b, worker.execute(plan_b))
    assert "c" in scheduler.poisoned and b in scheduler.waiting
    scheduler.update_from_output(plan_c, worker.execute(plan_c))
    assert c in scheduler.waiting and not scheduler.poisoned
    _plans, outputs = run(scheduler, worker, [])
    assert outputs["b"] == expected() and outputs["c"] == expected()
    check_invariants(scheduler)


def test_failures_outside_the_plan_are_only_forgotten():
    scheduler, worker = build()
    first = request("a")
    run(scheduler, worker, [first])
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, RunnerOutput(kv_load_failures=[first.block_hashes[1]]))
    assert first.block_hashes[1] not in scheduler.kv.offload
    assert scheduler.num_preemptions == 0


def test_what_an_aborted_request_computed_after_a_failed_load_is_never_read():
    """b loads blocks 0-4 (block 1 fails) and computes 5-6 on that garbage, and is aborted
    while its step runs: the blocks from 1 on leave the caches all the same, so later
    requests of the same prompt never read them."""
    scheduler, worker = build()
    first = request("a")
    run(scheduler, worker, [first])
    assert scheduler.kv.reset_prefix_cache()
    worker.corrupt(first.block_hashes[1])
    longer = [*PROMPT, *range(200, 208)]  # 7 full blocks and 2 tokens
    scheduler.add_request(request("b", longer))
    plan = scheduler.schedule()
    assert len(plan.kv_loads) == 5 and len(plan.kv_saves) == 2
    scheduler.abort_requests(["b"])
    scheduler.update_from_output(plan, worker.execute(plan))
    check_invariants(scheduler)
    for rid in ("d", "e"):
        _plans, outputs = run(scheduler, worker, [request(rid, longer)])
        assert outputs[rid] == expected(longer), rid
