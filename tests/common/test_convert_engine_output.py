"""EngineOutputBatch's typed fields: finish reasons and error codes as enums, absence as
presence."""

from __future__ import annotations

import pytest

from services.common.convert.engine_io import outputs_from_pb, outputs_to_pb
from services.common.engine_output import EngineCoreOutput, EngineCoreOutputs
from services.common.proto.pagestream.internal.v1 import engine_pb2

CODES = {
    None: engine_pb2.ERROR_CODE_INVALID_ARGUMENT,
    "unavailable": engine_pb2.ERROR_CODE_UNAVAILABLE,
    "resource_exhausted": engine_pb2.ERROR_CODE_RESOURCE_EXHAUSTED,
    "internal": engine_pb2.ERROR_CODE_INTERNAL,
}


def _wire(message):
    return type(message).FromString(message.SerializeToString())


def test_error_codes_travel_as_enums():
    outputs = [
        EngineCoreOutput(f"r{i}", [], finish_reason="error", error="no", error_code=code)
        for i, code in enumerate(CODES)
    ]
    message = _wire(outputs_to_pb(EngineCoreOutputs(outputs)))
    assert [o.error.code for o in message.outputs] == list(CODES.values())
    assert {o.finish_reason for o in message.outputs} == {engine_pb2.FINISH_REASON_ERROR}
    assert outputs_from_pb(message) == EngineCoreOutputs(outputs)


def test_a_running_output_sets_nothing_optional():
    message = _wire(outputs_to_pb(EngineCoreOutputs([EngineCoreOutput("a", [1, 2])])))
    output = message.outputs[0]
    assert output.finish_reason == engine_pb2.FINISH_REASON_NONE
    present = {field.name for field, _ in output.ListFields()}
    assert present == {"request_id", "new_token_ids"}
    assert outputs_from_pb(message).outputs == [EngineCoreOutput("a", [1, 2])]


def test_unknown_enum_values_are_refused():
    batch = EngineCoreOutputs([EngineCoreOutput("a", [], finish_reason="error", error="x")])
    message = outputs_to_pb(batch)
    message.outputs[0].finish_reason = 99
    with pytest.raises(ValueError, match="FinishReason"):
        outputs_from_pb(message)
    message = outputs_to_pb(batch)
    message.outputs[0].error.code = 99
    with pytest.raises(ValueError, match="ErrorCode"):
        outputs_from_pb(message)
    with pytest.raises(ValueError, match="finish reason"):
        outputs_to_pb(EngineCoreOutputs([EngineCoreOutput("a", [], finish_reason="done")]))


def test_a_first_prompt_position_alone_still_travels():
    # [None]: the prompt's first position, which has no logprob, is still a position.
    batch = EngineCoreOutputs([EngineCoreOutput("a", [1], new_prompt_logprobs=[None])])
    message = _wire(outputs_to_pb(batch))
    assert message.outputs[0].HasField("prompt_logprobs")
    assert not message.outputs[0].HasField("logprobs")
    assert outputs_from_pb(message) == batch
