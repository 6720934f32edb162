"""pb <-> domain conversion: exact round trips, field presence, malformed messages."""

from dataclasses import fields, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.convert.engine_io import (
    engine_request_from_pb,
    engine_request_to_pb,
    outputs_from_pb,
    outputs_to_pb,
    served_model_info_from_pb,
    served_model_info_to_pb,
    stats_from_pb,
    stats_to_pb,
)
from services.common.convert.plan_limits import PlanLimits
from services.common.convert.sampling import (
    INT32_MAX,
    sampling_params_from_pb,
    sampling_params_to_pb,
    shortest_float32,
)
from services.common.convert.step import plan_from_pb, plan_to_pb, result_from_pb, result_to_pb
from services.common.convert.worker_info import (
    cache_description_from_pb,
    cache_description_to_pb,
    worker_description_from_pb,
    worker_description_to_pb,
)
from services.common.engine_output import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from services.common.engine_request import EngineCoreRequest
from services.common.proto.pagestream.internal.v1 import worker_pb2
from services.common.proto.pagestream.v1 import generation_pb2
from services.common.reasoning_bounds import ReasoningBounds, ReasoningMode
from services.common.runner_output import RunnerOutput, StepTimings, TokenLogprobs
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.common.served_model_info import ServedModelInfo
from services.common.structured_outputs import StructuredOutputsParams
from services.common.worker_info import CacheInfo, ModelInfo

# Every field differs from vLLM's default; float values a user would type.
EVERY_FIELD = SamplingParams(
    n=3,
    presence_penalty=0.5,
    frequency_penalty=-0.3,
    repetition_penalty=1.1,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=2**40 + 7,
    stop=["\n\n", "END"],
    stop_token_ids=[7, 8],
    ignore_eos=True,
    max_tokens=100,
    min_tokens=3,
    logprobs=5,
    prompt_logprobs=2,
    logit_bias={5: -1.5, 9: 100.0, 0: 0.1},
    skip_special_tokens=False,
    spaces_between_special_tokens=False,
    include_stop_str_in_output=True,
    length_penalty=0.8,
    structured_outputs=StructuredOutputsParams(regex="[a-z]+ [0-9]{2}"),
    thinking_token_budget=64,
    reasoning=ReasoningBounds(ReasoningMode.OPTIONAL, (300,), (301, 302), (10, 301, 302, 10)),
)


def _wire(message):
    """Serialize and parse, as the transport does."""
    return type(message).FromString(message.SerializeToString())


def _round_trip_params(params: SamplingParams) -> SamplingParams:
    return sampling_params_from_pb(_wire(sampling_params_to_pb(params)))


# ---- SamplingParams -------------------------------------------------------------------
def test_every_sampling_field_round_trips_and_is_present_on_the_wire():
    message = sampling_params_to_pb(EVERY_FIELD)
    present = {f.name for f, _ in message.ListFields()}
    expected = {f.name for f in generation_pb2.SamplingParams.DESCRIPTOR.fields}
    assert expected - present == {"use_beam_search"}  # False is the default
    back = _round_trip_params(EVERY_FIELD)
    assert back == EVERY_FIELD
    assert back.temperature == 0.7 and back.min_p == 0.05  # float32 on the wire, exact back


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputsParams(json='{"type": "object"}', disable_any_whitespace=True),
        StructuredOutputsParams(choice=["yes", "no", 'say "hi"']),
        StructuredOutputsParams(grammar='start: "a"+', disable_additional_properties=True),
        StructuredOutputsParams(json_object=True, whitespace_pattern=" ?"),
    ],
)
def test_every_structured_output_kind_round_trips(constraint):
    back = _round_trip_params(SamplingParams(structured_outputs=constraint)).structured_outputs
    assert back == constraint and back.grammar_key == constraint.grammar_key


def test_a_json_schema_object_travels_as_its_text_and_compiles_the_same():
    constraint = StructuredOutputsParams(json={"type": "object", "required": ["a"]})
    back = _round_trip_params(SamplingParams(structured_outputs=constraint)).structured_outputs
    assert back.grammar_key == constraint.grammar_key


def test_an_empty_structured_outputs_message_is_refused_by_name():
    message = generation_pb2.SamplingParams(structured_outputs=generation_pb2.StructuredOutputs())
    with pytest.raises(ValueError, match="structured_outputs needs one of"):
        sampling_params_from_pb(message)


@pytest.mark.parametrize("budget", [0, 1, 2**31 - 1])
def test_thinking_budgets_round_trip_with_zero_apart_from_unset(budget):
    bounds = ReasoningBounds(ReasoningMode.THINKING, (), (7,), (7,))
    back = _round_trip_params(SamplingParams(thinking_token_budget=budget, reasoning=bounds))
    assert back.thinking_token_budget == budget and back.reasoning == bounds
    assert _round_trip_params(SamplingParams(reasoning=bounds)).thinking_token_budget is None


@pytest.mark.parametrize("mode", list(ReasoningMode))
def test_reasoning_bounds_round_trip_in_every_mode(mode):
    bounds = ReasoningBounds(mode, (5,), (6, 7), (8, 6, 7))
    assert _round_trip_params(SamplingParams(reasoning=bounds)).reasoning == bounds


@pytest.mark.parametrize(
    ("bounds", "problem"),
    [
        (generation_pb2.ReasoningBounds(mode=9, end_token_ids=[1]), "reasoning.mode"),
        (generation_pb2.ReasoningBounds(mode=1), "end_token_ids must not be empty"),
        (generation_pb2.ReasoningBounds(mode=1, end_token_ids=[-3]), "token ids >= 0"),
        (generation_pb2.ReasoningBounds(end_token_ids=[1] * 65), "at most 64"),
    ],
)
def test_malformed_reasoning_bounds_are_refused_by_name(bounds, problem):
    with pytest.raises(ValueError, match=problem):
        sampling_params_from_pb(_wire(generation_pb2.SamplingParams(reasoning=bounds)))


def test_a_budget_without_bounds_on_the_wire_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"thinking_token_budget.*--reasoning-parser"):
        sampling_params_from_pb(generation_pb2.SamplingParams(thinking_token_budget=5))


def test_beam_search_params_round_trip():
    params = SamplingParams(n=4, temperature=0.0, use_beam_search=True, length_penalty=1.5)
    assert _round_trip_params(params) == params


def test_defaults_are_an_empty_message_and_unset_means_default():
    assert sampling_params_to_pb(SamplingParams()).ByteSize() == 0
    assert sampling_params_from_pb(generation_pb2.SamplingParams()) == SamplingParams()
    only = sampling_params_from_pb(generation_pb2.SamplingParams(temperature=0.0, max_tokens=4))
    assert only == SamplingParams(temperature=0.0, max_tokens=4)
    assert only.top_p == 1.0 and only.seed is None and only.logprobs is None


def test_presence_distinguishes_zero_from_unset():
    params = SamplingParams(seed=0, logprobs=0, prompt_logprobs=0, temperature=0.0)
    back = _round_trip_params(params)
    assert (back.seed, back.logprobs, back.prompt_logprobs, back.temperature) == (0, 0, 0, 0.0)


def test_unlimited_max_tokens_round_trips():
    params = SamplingParams(max_tokens=None)
    assert sampling_params_to_pb(params).max_tokens == INT32_MAX
    assert _round_trip_params(params).max_tokens is None


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (generation_pb2.SamplingParams(temperature=5.0), "temperature"),
        (generation_pb2.SamplingParams(top_p=float("nan")), "top_p"),
        (generation_pb2.SamplingParams(n=0), "n"),
        (generation_pb2.SamplingParams(max_tokens=0), "max_tokens"),
        (generation_pb2.SamplingParams(logprobs=99), "logprobs"),
        (generation_pb2.SamplingParams(logit_bias={3: 250.0}), "logit_bias"),
        (generation_pb2.SamplingParams(stop=[""]), "stop"),
    ],
)
def test_invalid_values_raise_value_errors_naming_the_field(message, field):
    with pytest.raises(ValueError, match=field):
        sampling_params_from_pb(message)


def test_values_that_do_not_fit_the_wire_name_the_field():
    with pytest.raises(ValueError, match="seed"):
        sampling_params_to_pb(SamplingParams(seed=2**70))


@given(st.floats(min_value=0.0, max_value=2.0, width=32))
def test_float32_values_come_back_to_the_same_float32(value):
    assert shortest_float32(shortest_float32(value)) == shortest_float32(value)
    back = _round_trip_params(SamplingParams(temperature=value)).temperature
    assert generation_pb2.SamplingParams(temperature=back).temperature == value


# ---- StepPlan / StepResult -------------------------------------------------------------
# The worker never sees a request's grammar nor its thinking bounds, only each step's masks.
WORKER_PARAMS = EVERY_FIELD.clone(
    structured_outputs=None, thinking_token_budget=None, reasoning=None
)


def _plan(params: SamplingParams = WORKER_PARAMS) -> SchedulerOutput:
    new = NewRequestData("new-1", [1, 2, 3], [], SamplingParams(temperature=0.0), ([4],), 0)
    resumed = NewRequestData("forked", [5, 6], [9, 10], params, ([7, 8, 11],), 2)
    cached = CachedRequestData(
        request_ids=["c-a", "c-b", "c-c", "c-d"],
        new_block_ids=[([],), ([12, 13],), ([],), ([14],)],
        num_computed_tokens=[17, 30, 5, 64],
        resumed_from_preemption=[False, True, False, False],
    )
    # Row order deliberately neither sorted nor new-first.
    order = {"c-b": 1, "new-1": 3, "c-a": 1, "forked": 1, "c-d": 2, "c-c": 16}
    return SchedulerOutput(
        scheduled_new_reqs=[new, resumed],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=order,
        total_num_scheduled_tokens=sum(order.values()),
        finished_req_ids={"gone-1", "gone-2"},
        blocks_to_copy=[(1, 2), (3, 4)],
        blocks_to_swap_in=[(0, 20)],
        blocks_to_swap_out=[(21, 1), (22, 2)],
        grammar_request_ids=["c-c", "forked"],
        grammar_bitmask=bytes(range(16)),
    )


def test_step_plan_round_trips_with_row_order():
    plan = _plan()
    message = _wire(plan_to_pb(plan, step_id=41))
    assert message.step_id == 41
    back = plan_from_pb(message)
    assert back == plan
    assert list(back.num_scheduled_tokens) == list(plan.num_scheduled_tokens)


def test_a_plan_sends_the_grammar_masks_but_not_the_grammars():
    back = plan_from_pb(_wire(plan_to_pb(_plan(EVERY_FIELD))))
    params = back.scheduled_new_reqs[1].kind
    assert params.structured_outputs is None and params.reasoning is None
    assert params.thinking_token_budget is None
    assert back == _plan(WORKER_PARAMS)


def test_empty_plan_round_trips():
    assert plan_from_pb(_wire(plan_to_pb(SchedulerOutput()))) == SchedulerOutput()


def test_decode_only_plan_round_trips():
    ids = [f"r{i}" for i in range(256)]
    plan = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(
            ids, [([],)] * 256, list(range(256)), [False] * 256
        ),
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=256,
    )
    assert plan_from_pb(_wire(plan_to_pb(plan))) == plan


def test_block_tables_travel_per_kv_cache_group():
    """Two groups: each table's lists come back per group (flat, position-major, only on
    the wire), and a table that does not fill its groups is refused."""
    new = NewRequestData("n", [1, 2, 3, 4, 5], [], SamplingParams(), ([4, 6], [5, 7]), 0)
    cached = CachedRequestData(["c"], [([8], [9])], [4], [False])
    plan = SchedulerOutput(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"n": 5, "c": 1},
        total_num_scheduled_tokens=6,
    )
    message = _wire(plan_to_pb(plan))
    assert message.num_kv_groups == 2 and list(message.new_requests[0].block_ids) == [4, 5, 6, 7]
    assert plan_from_pb(message) == plan
    message.new_requests[0].block_ids.append(10)
    with pytest.raises(ValueError, match="2 KV cache groups"):
        plan_from_pb(message)
    limits = PlanLimits(max_model_len=16, block_size=4, vocab_size=32, num_kv_groups=1)
    with pytest.raises(ValueError, match="KV cache groups, the worker has 1"):
        plan_from_pb(_wire(plan_to_pb(plan)), limits)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"cached_num_new_blocks": [1, 1]}, "cached_new_block_ids"),
        ({"blocks_to_copy": [1, 2, 3]}, "blocks_to_copy"),
        ({"num_scheduled_tokens": [1]}, "num_scheduled_tokens"),
        ({"num_scheduled_tokens": [1, 1, 0, 1, 1, 1]}, "fewer than 1 token"),
        ({"cached_resumed": [True]}, "cached_"),
        ({"spec_request_ids": ["ghost"], "num_spec_tokens": [1], "spec_token_ids": [5]}, "ghost"),
    ],
)
def test_malformed_plans_raise_value_error(changes, match):
    message = plan_to_pb(_plan())
    for name, values in changes.items():
        message.ClearField(name)
        getattr(message, name).extend(values)
    with pytest.raises(ValueError, match=match):
        plan_from_pb(message)


def _result() -> RunnerOutput:
    return RunnerOutput(
        request_ids=["a", "b", "c"],
        sampled_token_ids=[[5], [], [7, 8]],  # b is mid chunked prefill
        logprobs={
            "a": [TokenLogprobs([5, 1, 2], [-0.25, -1.5, -3.0], [1, 2, 3])],
            "c": [TokenLogprobs([7], [-0.5], [1]), TokenLogprobs([8, 9], [-2.0, -0.125], [2, 1])],
        },
        prompt_logprobs={
            "b": [None, TokenLogprobs([3, 4], [-4.0, -1.0], [7, 1])],
            "a": [TokenLogprobs([1], [-6.5], [40])],
            "c": [],
        },
        timings=StepTimings(prepare_s=0.001, forward_s=0.25, sample_s=0.0005),
    )


def test_step_result_round_trips_with_logprobs_and_none_positions():
    result = _result()
    message = _wire(result_to_pb(result, step_id=7))
    assert message.step_id == 7 and message.error == ""
    assert result_from_pb(message) == result


def test_step_result_without_logprobs_round_trips():
    result = RunnerOutput(["x", "y"], [[1], [2]])
    assert result_from_pb(_wire(result_to_pb(result))) == result


def test_step_result_error_travels():
    message = _wire(result_to_pb(RunnerOutput(), step_id=3, error="unknown request 'z'"))
    assert message.error == "unknown request 'z'" and message.step_id == 3


def test_malformed_result_raises_value_error():
    message = result_to_pb(_result())
    message.logprobs["a"].ranks.append(1)
    with pytest.raises(ValueError, match="Logprobs"):
        result_from_pb(message)


# ---- engine.proto ---------------------------------------------------------------------
def test_engine_request_round_trips():
    request = EngineCoreRequest(
        request_id="r-1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=EVERY_FIELD,
        eos_token_id=2,
        extra_stop_token_ids=(3, 4),
        priority=-5,
        cache_salt="tenant-a",
    )
    back = engine_request_from_pb(_wire(engine_request_to_pb(request)))
    assert back == replace(request, arrival_time=back.arrival_time)


def test_engine_request_without_eos_or_salt_round_trips():
    request = EngineCoreRequest("r-2", [4], SamplingParams())
    back = engine_request_from_pb(_wire(engine_request_to_pb(request)))
    assert back.eos_token_id is None and back.cache_salt is None
    assert back == replace(request, arrival_time=back.arrival_time)


def test_engine_request_needs_an_id():
    message = engine_request_to_pb(EngineCoreRequest("r", [1], SamplingParams()))
    message.request_id = ""
    with pytest.raises(ValueError, match="request_id"):
        engine_request_from_pb(message)


def test_engine_outputs_round_trip():
    stats = SchedulerStats(3, 2, 1, 0.375, 10, 4, 1)
    outputs = [
        EngineCoreOutput("a", [5, 6], new_logprobs=[TokenLogprobs([5], [-0.5], [1])] * 2),
        EngineCoreOutput(
            "grp-1",
            [9],
            finish_reason="stop",
            stop_reason=9,
            num_cached_tokens=16,
            parent_request_id="grp",
            index=1,
            new_prompt_logprobs=[None, TokenLogprobs([3, 4], [-1.25, -2.0], [2, 1])],
        ),
        EngineCoreOutput("beam", [1, 2, 3], finish_reason="length", cumulative_logprob=-3.5),
        EngineCoreOutput("bad", [], finish_reason="error", error="prompt too long"),
        EngineCoreOutput("gone", [], finish_reason="abort"),
    ]
    batch = EngineCoreOutputs(outputs, stats)
    assert outputs_from_pb(_wire(outputs_to_pb(batch))) == batch
    no_stats = EngineCoreOutputs(outputs[:1])
    assert outputs_from_pb(_wire(outputs_to_pb(no_stats))) == no_stats


def test_malformed_output_batch_raises_value_error():
    logprobs = [TokenLogprobs([5, 7], [-0.5, -1.5], [1, 2])]
    message = outputs_to_pb(EngineCoreOutputs([EngineCoreOutput("a", [5], new_logprobs=logprobs)]))
    message.outputs[0].logprobs.ranks.append(3)
    with pytest.raises(ValueError, match="differ from num_entries"):
        outputs_from_pb(message)
    message.outputs[0].logprobs.ranks.pop()
    message.outputs[0].logprobs.num_entries[:] = [3, -1]
    with pytest.raises(ValueError, match="negative"):
        outputs_from_pb(message)


def test_stats_and_model_info_round_trip():
    stats = SchedulerStats(1, 2, 3, 0.5, 100, 50, 7)
    assert stats_from_pb(_wire(stats_to_pb(stats))) == stats
    info = ServedModelInfo("tiny", 256, 512, (2, 3), 16, "LlamaForCausalLM", "float32", 1024)
    assert served_model_info_from_pb(_wire(served_model_info_to_pb(info))) == info


def test_worker_description_and_cache_info_round_trip():
    model = ModelInfo("m", "LlamaForCausalLM", "bfloat16", "cuda:0", 2, 4, 64, 512, (2,), 256)
    assert worker_description_from_pb(_wire(worker_description_to_pb(model))) == model
    cache = CacheInfo(1000, 64, 16, 2**20)
    assert cache_description_from_pb(_wire(cache_description_to_pb(cache))) == cache
    names = {f.name for f in worker_pb2.WorkerDescription.DESCRIPTOR.fields}
    assert names == {f.name for f in fields(ModelInfo)}
