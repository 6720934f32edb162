"""LoRA in the scheduler, over the stand-in worker with adapter slots: admission by
max_loras (never more adapters among the running requests), the plan's slot columns (each
row with an adapter names a slot the plan fills with that adapter; a slot keeps its
adapter while running requests use it), base requests passing an adapter that waits, the
prefix cache split by adapter, preemption and n > 1 keeping the adapter, the refusal when
LoRA is off, and the plan's LoRA columns on the wire."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.block_hash import hash_request_tokens
from services.common.config import CacheConfig, SchedulerConfig
from services.common.convert.engine_io import (
    engine_request_from_pb,
    engine_request_to_pb,
    stats_from_pb,
    stats_to_pb,
)
from services.common.convert.step import plan_from_pb, plan_to_pb
from services.common.engine_request import EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, SchedulerOutput
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor.uni import UniExecutor
from services.scheduler.lora_slot_table import LoRASlotTable
from services.scheduler.scheduler import RequestRejectedError, Scheduler
from tests.helpers.scheduler_invariants import check_invariants
from tests.scheduler.stand_in_worker import (
    StandInWorker,
    adapter,
    make_request,
    reference_generate,
)

A, B, C, D = (adapter(name) for name in "ABCD")
MAX_MODEL_LEN = 256


def _build(num_blocks, max_loras, block_size=4, num_cpu_blocks=0, caching=True, **config):
    config.setdefault("max_model_len", MAX_MODEL_LEN)
    scheduler = Scheduler(
        SchedulerConfig(**config),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_device_blocks=num_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_loras=max_loras,
    )
    worker = StandInWorker(num_blocks, block_size, num_cpu_blocks, max_loras=max_loras)
    return Driver(scheduler, worker)


class Driver:
    """Steps the scheduler over the worker and checks every plan and every step's end:
    the block-manager invariants, at most max_loras adapters among the running requests,
    every row's slot holding its request's adapter, no adapter in two slots, and the slot
    of a request that stays running never changing (nor its contents on the worker)."""

    def __init__(self, scheduler: Scheduler, worker: StandInWorker) -> None:
        self.scheduler, self.worker = scheduler, worker
        self.sequences = {}  # every request and forked sequence seen, by id
        self.plans: list[SchedulerOutput] = []
        self.slot_of: dict[str, int] = {}  # running requests' slots
        self.most_adapters = 0  # the most adapters running together

    def add(self, request) -> None:
        self.scheduler.add_request(request)
        self.sequences[request.request_id] = request

    def preempt(self, request) -> None:
        self.scheduler._preempt(request)
        self._check_running()

    def step(self):
        scheduler = self.scheduler
        plan = scheduler.schedule()
        self.sequences.update(scheduler.requests)  # forks join in schedule()
        self._check_plan(plan)
        outputs = scheduler.update_from_output(plan, self.worker.execute(plan))
        self.plans.append(plan)
        check_invariants(scheduler)
        self._check_running()
        return plan, outputs

    def run(self, max_steps: int = 5_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                if self.scheduler.has_pending_outputs():
                    self.step()
                return
            self.step()
        raise AssertionError("requests did not finish: the scheduler hangs")

    def _check_plan(self, plan: SchedulerOutput) -> None:
        check_plan_slots(plan, self.sequences, self.scheduler.loras.max_loras, self.slot_of)
        self._count_adapters()

    def _count_adapters(self) -> None:
        running = self.scheduler.running
        active = {r.lora_identity for r in running if r.lora_request is not None}
        assert len(active) <= self.scheduler.loras.max_loras, active
        self.most_adapters = max(self.most_adapters, len(active))

    def _check_running(self) -> None:
        self._count_adapters()
        running = self.scheduler.running
        ids = {r.request_id for r in running}
        self.slot_of = {rid: s for rid, s in self.slot_of.items() if rid in ids}
        for request in running:
            slot = self.slot_of.get(request.request_id)
            if slot is not None:  # a slot keeps its adapter while a running request uses it
                assert self.worker.slots[slot] == request.lora_identity, request.request_id

    def assert_reference_outputs(self, max_model_len: int = MAX_MODEL_LEN) -> None:
        for rid, sequence in self.sequences.items():
            expected = reference_generate(
                sequence.prompt_token_ids,
                sequence.sampling_params,
                max_model_len,
                lora=sequence.lora_request,
            )
            assert sequence.output_token_ids == expected, rid


def check_plan_slots(plan, sequences, max_loras: int, slot_of: dict[str, int]) -> None:
    """A plan's LoRA columns: every row with an adapter has a slot that the plan fills with
    that adapter, base rows have none, no adapter sits in two slots, only the slots the
    rows use are named, and a request keeps the slot of its previous row unless it left
    the worker in between (`slot_of`: the slots of earlier rows, updated here)."""
    identities = [lora.identity for lora in plan.lora_adapters.values()]
    assert len(identities) == len(set(identities)), f"an adapter in two slots: {plan}"
    assert set(plan.lora_adapters) <= set(range(max_loras))
    for rid in plan.finished_req_ids:
        slot_of.pop(rid, None)
    # sent in full or swapped back in: it left the worker (or the running requests) since
    returned = {n.request_id for n in plan.scheduled_new_reqs}
    cached = plan.scheduled_cached_reqs
    resumed = zip(cached.request_ids, cached.resumed_from_preemption, strict=True)
    returned |= {rid for rid, back in resumed if back}
    used = set()
    for rid in plan.num_scheduled_tokens:
        lora = sequences[rid].lora_request
        if lora is None:
            assert rid not in plan.lora_slots, f"base request {rid} has a slot"
            continue
        slot = plan.lora_slots[rid]
        assert plan.lora_adapters[slot] == lora, f"{rid} runs in {slot} of another adapter"
        if rid in slot_of and rid not in returned:
            assert slot == slot_of[rid], f"{rid} moved from slot {slot_of[rid]} to {slot}"
        used.add(slot)
    assert set(plan.lora_adapters) == used, "the plan names slots no row uses"
    slot_of.update(plan.lora_slots)


def _scheduled(plan) -> set[str]:
    return set(plan.num_scheduled_tokens)


def test_the_slot_table_fills_keeps_and_reuses_slots():
    table = LoRASlotTable(2)
    x, y, z = (make_request(n, [1], 4, lora) for n, lora in (("x", A), ("y", B), ("z", C)))
    base = make_request("base", [1], 4, None)
    assert table.fits(base, [x, y]) and table.fits(x, [x, y]) and not table.fits(z, [x, y])
    assert table.fits(z, [x, base])
    assert table.assign([base], [base]) == ({}, {})  # no adapter: no slot
    assert table.assign([x, base], [x, base]) == ({"x": 0}, {0: A})
    assert table.assign([y, x], [x, y]) == ({"y": 1, "x": 0}, {1: B, 0: A})
    # x runs but is not in this step (its step is in flight): its slot, the least recently
    # used, is still not free; z takes y's (y ended)
    table.assign([y], [x, y])
    assert table.assign([z], [x, z]) == ({"z": 1}, {1: C})
    # an adapter that comes back finds its old slot while no other took it
    table.assign([x], [x])
    assert table.slots == [A, C]
    y2 = make_request("y2", [1], 4, B)
    assert table.assign([y2], [y2]) == ({"y2": 1}, {1: B})  # the least recently used
    assert table.assign([x], [x, y2]) == ({"x": 0}, {0: A})
    with pytest.raises(RuntimeError, match="more adapters are running"):
        table.assign([z], [x, y2, z])


def test_four_adapters_and_the_base_through_two_slots():
    driver = _build(64, max_loras=2, max_num_seqs=8, max_num_batched_tokens=48)
    loras = [None, A, B, C, D]
    for i in range(15):
        prompt = [i + 1] * (5 + i)
        driver.add(make_request(f"r{i}", prompt, 4, loras[i % 5], max_tokens=5 + i % 4))
    driver.run()
    assert driver.most_adapters == 2  # the limit was reached, never passed
    driver.assert_reference_outputs()
    # every adapter went through the slots, and the slots were reused
    seen = {lora.lora_name for p in driver.plans for lora in p.lora_adapters.values()}
    assert seen == {"A", "B", "C", "D"}
    assert driver.worker.loads >= 4
    assert driver.scheduler.kv.num_free_blocks == 64
    stats = driver.scheduler.get_stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters, stats.max_lora) == (
        (),
        (),
        2,
    )


def test_base_and_running_adapters_pass_an_adapter_that_waits_for_a_slot():
    driver = _build(64, max_loras=2)
    driver.add(make_request("a", [1] * 6, 4, A, max_tokens=8, ignore_eos=True))
    driver.add(make_request("b", [2] * 6, 4, B, max_tokens=4, ignore_eos=True))
    plan, _ = driver.step()
    assert _scheduled(plan) == {"a", "b"}
    driver.add(make_request("c", [3] * 6, 4, C, max_tokens=3, ignore_eos=True))
    driver.add(make_request("base", [4] * 6, 4, None, max_tokens=3, ignore_eos=True))
    driver.add(make_request("a2", [5] * 6, 4, A, max_tokens=3, ignore_eos=True))
    plan, _ = driver.step()
    assert _scheduled(plan) == {"a", "b", "base", "a2"}  # c waits; who came after it runs
    assert [r.request_id for r in driver.scheduler.waiting] == ["c"]
    stats = driver.scheduler.get_stats()
    assert stats.running_lora_adapters == ("A", "B")
    assert stats.waiting_lora_adapters == ("C",)
    assert stats.max_lora == 2
    first_c = None
    while driver.scheduler.has_unfinished_requests():
        plan, _ = driver.step()
        if "c" in plan.num_scheduled_tokens and first_c is None:
            first_c = len(driver.plans) - 1
            # it took the slot of b (finished); a kept its own
            assert driver.sequences["b"].is_finished and not driver.sequences["a"].is_finished
            assert plan.lora_slots["c"] != driver.plans[0].lora_slots["a"]
    assert first_c is not None
    driver.assert_reference_outputs()


def test_a_waiting_adapter_keeps_its_place_among_other_waiting_requests():
    driver = _build(64, max_loras=1, max_num_seqs=2)
    driver.add(make_request("a", [1] * 6, 4, A, max_tokens=6, ignore_eos=True))
    driver.add(make_request("b", [2] * 6, 4, B, max_tokens=2, ignore_eos=True))
    driver.add(make_request("base", [3] * 6, 4, None, max_tokens=2, ignore_eos=True))
    plan, _ = driver.step()
    assert _scheduled(plan) == {"a", "base"}  # max_num_seqs 2: b waits for a's slot
    assert [r.request_id for r in driver.scheduler.waiting] == ["b"]
    driver.run()
    driver.assert_reference_outputs()


def _admitted(driver, rid, prompt, lora, **kwargs) -> int:
    """Runs one request to its end; the tokens its first step found cached."""
    driver.add(make_request(rid, prompt, 4, lora, max_tokens=2, ignore_eos=True, **kwargs))
    plan, _ = driver.step()
    (new,) = [n for n in plan.scheduled_new_reqs if n.request_id == rid]
    driver.run()
    return new.num_computed_tokens


def test_the_prefix_cache_is_split_by_adapter():
    driver = _build(64, max_loras=2)
    prompt = list(range(10, 26))  # 4 full blocks of 4
    reloaded = replace(A, lora_int_id=A.lora_int_id + 100, digest="d1")  # same name
    hits = [
        _admitted(driver, "a1", prompt, A),
        _admitted(driver, "a2", prompt, A),
        _admitted(driver, "b1", prompt, B),
        _admitted(driver, "base1", prompt, None),
        _admitted(driver, "base2", prompt, None),
        _admitted(driver, "b2", prompt, B),
        _admitted(driver, "reloaded", prompt, reloaded),
        _admitted(driver, "salted", prompt, A, cache_salt="s"),
    ]
    # 12: the whole prompt but its last block (its last token is always computed)
    assert hits == [0, 12, 0, 0, 12, 12, 0, 0]
    driver.assert_reference_outputs()  # and no row read KV another adapter wrote


def test_same_prompt_under_two_adapters_never_shares_blocks():
    driver = _build(64, max_loras=2)
    prompt = list(range(30, 46))
    driver.add(make_request("a1", prompt, 4, A, max_tokens=6, ignore_eos=True))
    driver.add(make_request("b1", prompt, 4, B, max_tokens=6, ignore_eos=True))
    driver.add(make_request("base", prompt, 4, None, max_tokens=6, ignore_eos=True))
    driver.step()
    kv = driver.scheduler.kv
    tables = {rid: set(kv.block_table(rid)[0]) for rid in ("a1", "b1", "base")}
    assert not tables["a1"] & tables["b1"]
    assert not (tables["a1"] | tables["b1"]) & tables["base"]
    driver.add(make_request("a2", prompt, 4, A, max_tokens=6, ignore_eos=True))
    driver.step()
    shared = kv.block_table("a1")[0][:3]
    assert kv.block_table("a2")[0][:3] == shared  # the same adapter reads a1's blocks
    assert all(kv.pool.blocks[b].ref_cnt == 2 for b in shared)
    assert not set(kv.block_table("a2")[0]) & (tables["b1"] | tables["base"])
    driver.run()
    driver.assert_reference_outputs()


class CheckingExecutor(UniExecutor):
    """Checks each plan's LoRA columns as the engine core submits it (its thread)."""

    def __init__(self, scheduler: Scheduler, worker, depth: int) -> None:
        super().__init__(worker, depth)
        self.scheduler, self.sequences, self.slot_of = scheduler, {}, {}

    def execute(self, plan):
        self.sequences.update(self.scheduler.requests)
        check_plan_slots(plan, self.sequences, self.scheduler.loras.max_loras, self.slot_of)
        running = self.scheduler.running
        assert len({r.lora_identity for r in running if r.lora_request}) <= 2
        return super().execute(plan)


def test_async_scheduling_keeps_slots_while_steps_are_in_flight():
    """With a batch queue of 2 the next plan is built while a running request's step is in
    flight (it is in no plan then): its adapter's slot is still not free for another."""
    driver = _build(64, max_loras=2, max_num_batched_tokens=32)
    scheduler, worker = driver.scheduler, driver.worker
    executor = CheckingExecutor(scheduler, worker, depth=2)
    core = EngineCore(scheduler, executor)
    loras = [A, B, None, C, A, D, B, None, C, D]
    for i, lora in enumerate(loras):
        prompt = [i + 1] * (4 + 3 * i)
        request = make_request(f"r{i}", prompt, 4, lora, max_tokens=3 + 2 * (i % 3))
        core.scheduler.add_request(request)
        executor.sequences[request.request_id] = request
    finished = set()
    while core.has_work():
        for batch in core.step().values():
            finished |= {o.request_id for o in batch.outputs if o.finished}
    executor.close()
    assert finished == {f"r{i}" for i in range(len(loras))}
    for rid, request in executor.sequences.items():
        expected = reference_generate(
            request.prompt_token_ids, request.sampling_params, 256, lora=request.lora_request
        )
        assert request.output_token_ids == expected, rid
    assert scheduler.kv.num_free_blocks == 64


def test_a_request_hashes_its_blocks_with_its_adapter():
    prompt = list(range(12))
    with_a = make_request("x", prompt, 4, A)
    base = make_request("y", prompt, 4, None)
    assert with_a.block_hashes == hash_request_tokens(prompt, 4, lora_identity=A.identity)
    assert base.block_hashes == hash_request_tokens(prompt, 4)
    assert not set(with_a.block_hashes) & set(base.block_hashes)


@pytest.mark.parametrize("max_loras", [1, 2])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_adapter(mode, max_loras):
    driver = _build(12, max_loras, num_cpu_blocks=32, preemption_mode=mode)
    for i, lora in enumerate([A, B, None, A]):
        prompt = [i + 1] * (5 + i)
        driver.add(make_request(f"r{i}", prompt, 4, lora, max_tokens=24, ignore_eos=True))
    driver.run()
    assert driver.scheduler.num_preemptions > 0
    driver.assert_reference_outputs()
    if mode == "swap":
        assert any(p.blocks_to_swap_out for p in driver.plans)
        assert any(p.blocks_to_swap_in for p in driver.plans)
    assert driver.scheduler.kv.num_free_blocks == 12
    assert len(driver.scheduler.kv.cpu_free) == 32


def test_parallel_sampling_keeps_the_adapter_and_counts_it_once():
    driver = _build(40, max_loras=2)
    driver.add(make_request("g", list(range(10)), 4, A, n=3, seed=7, max_tokens=6))
    driver.add(make_request("h", list(range(20, 30)), 4, B, max_tokens=6, ignore_eos=True))
    driver.run()
    group = [driver.sequences[rid] for rid in ("g", "g#1", "g#2")]
    assert all(s.lora_request == A for s in group)
    forked = [p for p in driver.plans if {"g", "g#1", "g#2", "h"} <= _scheduled(p)]
    assert forked  # the three sequences of A ran beside B's request (2 adapters, not 4)
    for plan in forked:
        assert plan.lora_slots["g"] == plan.lora_slots["g#1"] == plan.lora_slots["g#2"]
        assert plan.lora_slots["h"] != plan.lora_slots["g"]
    assert [s.sampling_params.seed for s in group] == [7, 8, 9]
    driver.assert_reference_outputs()
    assert len({tuple(s.output_token_ids) for s in group}) == 3


def test_beam_search_keeps_the_adapter():
    driver = _build(64, max_loras=1)
    params = dict(n=2, use_beam_search=True, max_tokens=4, ignore_eos=True)
    driver.add(make_request("beam", list(range(8)), 4, A, **params))
    driver.run()
    beams = [s for rid, s in driver.sequences.items() if rid != "beam"]
    assert beams and all(s.lora_request == A for s in beams)
    assert all(
        set(p.lora_slots) == set(p.num_scheduled_tokens) for p in driver.plans if p.lora_slots
    )


def test_an_adapter_is_refused_when_lora_is_off():
    driver = _build(16, max_loras=0)
    with pytest.raises(RequestRejectedError, match=r"LoRA adapter 'A'.*--enable-lora"):
        driver.scheduler.add_request(make_request("a", [1, 2, 3], 4, A))
    assert "a" not in driver.scheduler.requests and not driver.scheduler.waiting
    core = EngineCore(driver.scheduler, UniExecutor(driver.worker, 1))
    request = EngineCoreRequest("e", [1, 2, 3], SamplingParams(max_tokens=2), lora_request=B)
    with pytest.raises(RequestRejectedError, match="LoRA adapter 'B'"):
        core.add_request(request)
    core.add_request(EngineCoreRequest("base", [1, 2, 3], SamplingParams(max_tokens=2)))
    finished = []
    while core.has_work():
        for batch in core.step().values():
            finished += [o.request_id for o in batch.outputs if o.finished]
    assert finished == ["base"]
    assert driver.scheduler.get_stats().max_lora == 0


def test_the_plans_lora_columns_round_trip():
    driver = _build(64, max_loras=2)
    for i, lora in enumerate([A, None, B, A]):
        driver.add(make_request(f"r{i}", [i + 1] * 9, 4, lora, max_tokens=3))
    driver.run()
    plans = [p for p in driver.plans if p.lora_adapters]
    assert any(
        len(p.lora_adapters) == 2 and len(p.lora_slots) < len(p.num_scheduled_tokens) for p in plans
    )
    for plan in driver.plans:
        back = plan_from_pb(_wire(plan_to_pb(plan)))
        assert back == plan
    named = replace(A, base_model_name="tiny-llama")
    plan = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(
            ["x", "y", "z"], [([],)] * 3, [4, 5, 6], [False] * 3
        ),
        num_scheduled_tokens={"x": 1, "y": 1, "z": 1},
        total_num_scheduled_tokens=3,
        lora_slots={"z": 1, "x": 0},
        lora_adapters={1: named, 0: B},
    )
    back = plan_from_pb(_wire(plan_to_pb(plan)))
    assert back == plan and back.lora_adapters[1].base_model_name == "tiny-llama"
    assert back.lora_adapters[1].identity == named.identity  # the digest travels


@pytest.mark.parametrize(
    ("column", "values", "match"),
    [
        ("lora_request_slots", [0], "lora_request_ids and lora_request_slots"),
        ("lora_slots", [0, 1, 2], "lora_slots and lora_adapters"),
    ],
)
def test_malformed_lora_columns_raise_value_error(column, values, match):
    plan = SchedulerOutput(lora_slots={"x": 0, "y": 1}, lora_adapters={0: A, 1: B})
    message = plan_to_pb(plan)
    message.ClearField(column)
    getattr(message, column).extend(values)
    with pytest.raises(ValueError, match=match):
        plan_from_pb(message)


def test_an_adapter_without_an_id_is_refused_off_the_wire():
    message = plan_to_pb(SchedulerOutput(lora_slots={"x": 0}, lora_adapters={0: A}))
    message.lora_adapters[0].id = 0
    with pytest.raises(ValueError, match="lora_int_id"):
        plan_from_pb(message)


def test_a_request_and_the_stats_carry_adapters_over_the_wire():
    request = EngineCoreRequest("r", [1, 2], SamplingParams(), cache_salt="s", lora_request=A)
    back = engine_request_from_pb(_wire(engine_request_to_pb(request)))
    assert back == replace(request, arrival_time=back.arrival_time)
    assert back.lora_request.identity == A.identity
    base = EngineCoreRequest("b", [1], SamplingParams())
    assert engine_request_from_pb(_wire(engine_request_to_pb(base))).lora_request is None
    driver = _build(64, max_loras=2)
    driver.add(make_request("a", [1] * 6, 4, A, max_tokens=4))
    driver.add(make_request("b", [2] * 6, 4, B, max_tokens=4))
    driver.add(make_request("c", [3] * 6, 4, C, max_tokens=4))
    driver.step()
    stats = driver.scheduler.get_stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (("A", "B"), ("C",))
    assert stats_from_pb(_wire(stats_to_pb(stats))) == stats


def _wire(message):
    return type(message).FromString(message.SerializeToString())


# ---- random interleavings --------------------------------------------------------------
request_st = st.tuples(
    st.integers(1, 24),  # prompt length
    st.integers(0, 4),  # adapter: none, A, B, C, D
    st.integers(0, 2),  # shared-prefix family
    st.integers(1, 10),  # max_tokens
    st.sampled_from([1, 1, 1, 2]),  # n
)
op_st = st.one_of(
    st.tuples(st.just("add"), request_st),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.just(0)),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op_st, min_size=1, max_size=40),
    max_loras=st.sampled_from([1, 2, 3]),
    mode=st.sampled_from(["recompute", "swap"]),
    caching=st.booleans(),
    budget=st.sampled_from([8, 32]),
)
def test_random_interleavings_keep_adapters_and_slots_right(ops, max_loras, mode, caching, budget):
    driver = _build(
        16,
        max_loras,
        num_cpu_blocks=24,
        caching=caching,
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        max_model_len=64,
        preemption_mode=mode,
    )
    loras = [None, A, B, C, D]
    added, aborted = {}, set()
    for op, arg in ops:
        if op == "add":
            length, which, family, max_tokens, n = arg
            rid = f"r{len(added)}"
            prompt = ([100 + family] * 8 + list(range(len(added), 64)))[:length]
            seed = len(added) if n > 1 else None
            request = make_request(
                rid, prompt, 4, loras[which], max_tokens=max_tokens, n=n, seed=seed
            )
            driver.add(request)
            added[rid] = request
        elif op == "step":
            for _ in range(arg):
                driver.step()
        elif op == "abort" and added:
            rid = sorted(added)[arg % len(added)]
            driver.scheduler.abort_requests([rid])
            aborted.add(rid)
        elif op == "preempt" and driver.scheduler.running:
            driver.preempt(driver.scheduler.running[-1])
        check_invariants(driver.scheduler)
    driver.run()
    assert driver.scheduler.kv.num_free_blocks == 16 and not driver.scheduler.requests
    for rid, request in driver.sequences.items():
        if request.group_id in aborted or rid in aborted:
            continue
        expected = reference_generate(
            request.prompt_token_ids, request.sampling_params, 64, lora=request.lora_request
        )
        assert request.output_token_ids == expected, rid
