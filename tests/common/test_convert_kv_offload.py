"""The KV offload columns of StepPlan / StepResult: round trips, and the checks a plan from
the wire passes (key lengths, tier names, parallel columns, block ids, bounded counts)."""

import pytest

from services.common.convert.plan_limits import MAX_KV_DROPS, PlanLimits
from services.common.convert.step import plan_from_pb, plan_to_pb, result_from_pb, result_to_pb
from services.common.proto.pagestream.internal.v1 import worker_pb2
from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput

K1, K2, K3 = (bytes([i]) * 32 for i in (1, 2, 3))
LIMITS = PlanLimits(max_model_len=64, block_size=4, vocab_size=32, num_blocks=8)


def _wire(message):
    return type(message).FromString(message.SerializeToString())


def _plan(**fields) -> SchedulerOutput:
    base = {"kv_drops": [(K1, "host"), (K1, "disk")], "kv_loads": [(K2, 3)], "kv_saves": [(5, K3)]}
    return SchedulerOutput(**{**base, **fields})


def test_the_offload_columns_round_trip_both_ways():
    plan = _plan()
    assert plan_from_pb(_wire(plan_to_pb(plan)), LIMITS) == plan
    result = RunnerOutput(kv_load_failures=[K2])
    assert result_from_pb(_wire(result_to_pb(result))).kv_load_failures == [K2]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"kv_drop_keys": [b"short"], "kv_drop_tiers": ["host"]}, "32 bytes"),
        ({"kv_drop_keys": [K1], "kv_drop_tiers": ["cloud"]}, "'cloud' is not one of"),
        ({"kv_load_keys": [K1, K2], "kv_load_blocks": [1]}, "differ in length"),
        ({"kv_save_blocks": [1], "kv_save_keys": [K1 + b"x"]}, "32 bytes"),
    ],
)
def test_a_malformed_offload_column_is_refused_by_name(changes, match):
    message = worker_pb2.StepPlan(**changes)
    with pytest.raises(ValueError, match=match):
        plan_from_pb(message)


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        (_plan(kv_loads=[(K2, 8)]), "kv_loads: a block id outside 0..7"),
        (_plan(kv_saves=[(-1, K3)]), "kv_saves: a block id outside"),
        (_plan(kv_loads=[(K2, 1), (K3, 1)]), "two keys loaded into one block"),
        (_plan(kv_saves=[(i % 8, K3) for i in range(9)]), "9 blocks, the device has 8"),
        (_plan(kv_drops=[(K1, "disk")] * (MAX_KV_DROPS + 1)), "kv_drops"),
    ],
)
def test_a_plan_past_the_worker_limits_is_refused(plan, match):
    with pytest.raises(ValueError, match=match):
        plan_from_pb(_wire(plan_to_pb(plan)), LIMITS)
