"""Pooling on the wire: PoolingParams, pooled states (exact float32), the pooling flags of
plans, results, engine outputs and model info."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from services.common.convert.capabilities import capabilities_from_pb, capabilities_to_pb
from services.common.convert.engine_io import (
    engine_request_from_pb,
    engine_request_to_pb,
    outputs_from_pb,
    outputs_to_pb,
    served_model_info_from_pb,
    served_model_info_to_pb,
)
from services.common.convert.pooling import pooled_from_bytes, pooled_to_bytes
from services.common.convert.step import plan_from_pb, plan_to_pb, result_from_pb, result_to_pb
from services.common.engine_output import EngineCoreOutput, EngineCoreOutputs
from services.common.engine_request import EngineCoreRequest
from services.common.model_capabilities import ModelCapabilities
from services.common.pooler_config import PoolerConfig
from services.common.pooling_params import PoolingParams
from services.common.runner_output import RunnerOutput
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import NewRequestData, SchedulerOutput
from services.common.served_model_info import ServedModelInfo

STATE = np.array([0.1, -2.5, 3.0e-8, 7.0, np.float32(1 / 3)], np.float32)


def _wire(message):
    return type(message).FromString(message.SerializeToString())


@pytest.mark.parametrize(
    "params",
    [
        PoolingParams(),
        PoolingParams(dimensions=32, normalize=False, truncate_prompt_tokens=-1),
        PoolingParams(task="encode", truncate_prompt_tokens=7),
    ],
)
def test_pooling_requests_round_trip(params):
    request = EngineCoreRequest("p", [1, 2, 3], pooling_params=params)
    back = engine_request_from_pb(_wire(engine_request_to_pb(request)))
    assert back.pooling_params == params
    plain = EngineCoreRequest("g", [1], SamplingParams())
    assert engine_request_from_pb(_wire(engine_request_to_pb(plain))).pooling_params is None


def test_pooled_states_travel_exactly():
    np.testing.assert_array_equal(pooled_from_bytes(pooled_to_bytes(STATE)), STATE)
    assert pooled_from_bytes(pooled_to_bytes(None)) is None
    with pytest.raises(ValueError, match="float32"):
        pooled_from_bytes(b"\x00\x01\x02")


def test_engine_outputs_carry_the_pooled_state_of_their_final_output():
    outputs = [
        EngineCoreOutput("gen", [5, 6]),
        EngineCoreOutput("pool", [], finish_reason="stop", pooled=STATE),
    ]
    back = outputs_from_pb(_wire(outputs_to_pb(EngineCoreOutputs(outputs)))).outputs
    assert back[0].pooled is None and back[0].new_token_ids == [5, 6]
    np.testing.assert_array_equal(back[1].pooled, STATE)
    assert back[1].finish_reason == "stop"
    message = outputs_to_pb(EngineCoreOutputs(outputs))
    message.outputs[1].pooled = b"\x00\x01\x02"
    with pytest.raises(ValueError, match="pooled"):
        outputs_from_pb(message)


def test_plans_and_results_carry_pooling():
    new = NewRequestData("p", [1, 2, 3], [], PoolingParams(), ([0],), 0)
    plan = SchedulerOutput(
        scheduled_new_reqs=[new], num_scheduled_tokens={"p": 3}, total_num_scheduled_tokens=3
    )
    assert plan_from_pb(_wire(plan_to_pb(plan))) == plan
    result = RunnerOutput(["p", "g"], [[], [4]], pooled={"p": STATE})
    back = result_from_pb(_wire(result_to_pb(result)))
    assert back.sampled_token_ids == [[], [4]] and list(back.pooled) == ["p"]
    np.testing.assert_array_equal(back.pooled["p"], STATE)
    message = result_to_pb(result)
    message.pooled["p"] = b"\x00\x01\x02"
    with pytest.raises(ValueError, match="pooled"):
        result_from_pb(message)


def test_model_info_says_the_runner():
    pooler = PoolerConfig(
        pooling_type="MEAN",
        normalize=True,
        hidden_size=64,
        matryoshka_dimensions=(32, 64),
        num_labels=2,
        score_activation="softmax",
        labels=("no", "yes"),
        prompts={"query": "query: "},
        default_prompt_name="query",
    )
    capabilities = ModelCapabilities(can_generate=False, pooler=pooler)
    info = ServedModelInfo("m", 256, 512, (2,), capabilities=capabilities)
    message = _wire(served_model_info_to_pb(info))
    assert message.runner == "pooling" and not message.capabilities.can_generate
    assert message.capabilities.pooler.labels == ["no", "yes"]
    assert not message.capabilities.HasField("lora")
    back = served_model_info_from_pb(message)
    assert back == info and back.capabilities.pooler == pooler
    unset = PoolerConfig(pooling_type="LAST")  # normalize, dimensions unset stay unset
    assert capabilities_from_pb(_wire(capabilities_to_pb(ModelCapabilities(pooler=unset)))) == (
        ModelCapabilities(pooler=unset)
    )
    assert (
        served_model_info_from_pb(
            _wire(served_model_info_to_pb(ServedModelInfo("g", 8, 8, ())))
        ).runner
        == "generate"
    )


def test_a_pooling_request_travels_without_sampling_params():
    request = EngineCoreRequest("p", [1, 2, 3], pooling_params=PoolingParams(dimensions=8))
    message = _wire(engine_request_to_pb(request))
    assert not message.HasField("sampling_params") and message.HasField("pooling_params")
    back = engine_request_from_pb(message)
    assert back.sampling_params is None
    assert back == replace(request, arrival_time=back.arrival_time)
    new = NewRequestData("p", [1, 2, 3], [], PoolingParams(), ([0],), 0)
    plan = SchedulerOutput(
        scheduled_new_reqs=[new], num_scheduled_tokens={"p": 3}, total_num_scheduled_tokens=3
    )
    step = _wire(plan_to_pb(plan))
    assert not step.new_requests[0].HasField("sampling_params")
    assert plan_from_pb(step).scheduled_new_reqs == [new]


def test_an_add_request_is_one_kind_and_refuses_none_by_name():
    request = engine_request_to_pb(EngineCoreRequest("r", [1], SamplingParams()))
    request.pooling_params.task = "embed"  # a oneof: setting one kind clears the other
    assert request.WhichOneof("kind") == "pooling_params"
    assert not request.HasField("sampling_params")
    request.ClearField("pooling_params")
    with pytest.raises(ValueError, match=r"sampling_params.*pooling_params.*got neither"):
        engine_request_from_pb(request)


def test_a_plans_new_request_is_one_kind_and_refuses_none_by_name():
    plan = plan_to_pb(
        SchedulerOutput(
            scheduled_new_reqs=[NewRequestData("r", [1], [], SamplingParams(), ([0],), 0)],
            num_scheduled_tokens={"r": 1},
            total_num_scheduled_tokens=1,
        )
    )
    message = plan.new_requests[0]
    message.pooling_params.task = "embed"  # a oneof: setting one kind clears the other
    assert message.WhichOneof("kind") == "pooling_params"
    assert not message.HasField("sampling_params")
    message.ClearField("pooling_params")
    with pytest.raises(ValueError, match=r"sampling_params.*pooling_params.*got neither"):
        plan_from_pb(plan)
