"""Speculative decoding's config and wire: SpeculativeConfig.parse (vLLM's dict or JSON,
its inferences and defaults, errors that name the field), --speculative-config reaching a
child role, and the spec_* columns of StepPlan / StepResult, the spec_decode_* stats and
the model descriptions round-tripping."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pagestream.cli import build_parser
from pagestream.engine_args import EngineArgs
from services.common.convert.engine_io import (
    served_model_info_from_pb,
    served_model_info_to_pb,
    stats_from_pb,
    stats_to_pb,
)
from services.common.convert.step import plan_from_pb, plan_to_pb, result_from_pb, result_to_pb
from services.common.convert.worker_info import (
    worker_description_from_pb,
    worker_description_to_pb,
)
from services.common.engine_output import SchedulerStats, add_stats
from services.common.flags import from_flags, to_flags
from services.common.model_capabilities import ModelCapabilities
from services.common.runner_output import RunnerOutput, TokenLogprobs
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.common.served_model_info import ServedModelInfo
from services.common.speculative_config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from services.common.worker_info import ModelInfo


def _wire(message):
    return type(message).FromString(message.SerializeToString())


# ---- parse -------------------------------------------------------------------------------
def test_no_speculation_spellings():
    for value in (None, {}, "", "  "):
        assert SpeculativeConfig.parse(value) is None


def test_vllms_dict_json_and_inferences():
    ngram = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    )
    assert ngram == SpeculativeConfig("ngram", 4, prompt_lookup_min=3, prompt_lookup_max=3)
    assert SpeculativeConfig.parse(ngram.to_json()) == ngram
    assert SpeculativeConfig.parse(ngram) is ngram
    both_default = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (both_default.prompt_lookup_min, both_default.prompt_lookup_max) == (5, 5)
    low_only = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    )
    assert (low_only.prompt_lookup_min, low_only.prompt_lookup_max) == (2, 2)
    for spelling in ("ngram", "[ngram]"):  # vLLM's older spelling
        old = SpeculativeConfig.parse({"model": spelling, "num_speculative_tokens": 3})
        assert old.method == "ngram" and old.model is None
    draft = SpeculativeConfig.parse({"model": "/m/draft", "num_speculative_tokens": 3})
    assert draft.method == "draft_model" and draft.num_lookahead_tokens == 3
    assert ngram.num_lookahead_tokens == 0
    assert SpeculativeConfig.parse(draft.to_json()) == draft
    assert draft.describe() == "draft_model k=3" and ngram.describe() == "ngram k=4"
    assert ngram.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE == 32
    explicit = {"method": "ngram", "num_speculative_tokens": 1, "disable_by_batch_size": 2}
    assert SpeculativeConfig.parse(explicit).disable_by_batch_size == 2


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative"),
        ({"method": "ngram", "num_speculative_tokens": -2}, "speculative_config.num_speculative"),
        ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_specul"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "speculative_config.num_specul"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, r"unknown keys \['k'\]"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "model": "/m/draft"},
            "speculative_config.model",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "speculative_config.prompt_lookup_min",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "speculative_config.prompt_lookup_max",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "speculative_config.disable_by_batch_size",
        ),
        ('{"method": "ngram", ', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_errors_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(value)
    with pytest.raises(ValueError, match=field):  # the engine arguments refuse it at once
        EngineArgs(speculative_config=value)


def test_the_flag_reaches_a_child_role_as_the_same_config():
    value = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    args = EngineArgs(model="m", speculative_config=value)
    argv = to_flags(args)
    assert "--speculative-config" in argv
    ns = build_parser().parse_args(["scheduler", "m", *argv])
    back = from_flags(EngineArgs, ns)
    assert json.loads(back.speculative_config) == value
    assert back.model_config().speculative == args.model_config().speculative
    assert args.model_config().speculative == SpeculativeConfig.parse(value)


# ---- the wire ----------------------------------------------------------------------------
def _plan_with_proposals() -> SchedulerOutput:
    new = NewRequestData("n", [1, 2, 3], [], SamplingParams(temperature=0.0), ([4],), 0)
    cached = CachedRequestData(
        request_ids=["a", "b", "c"],
        new_block_ids=[([],), ([9],), ([],)],
        num_computed_tokens=[17, 30, 5],
        resumed_from_preemption=[False, True, False],
        new_token_ids=[[7], [8, 9, 10], []],
    )
    order = {"b": 4, "n": 3, "a": 1, "c": 3}
    return SchedulerOutput(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=order,
        total_num_scheduled_tokens=sum(order.values()),
        grammar_request_ids=["b", "b", "b", "b"],  # one row per verified position
        grammar_bitmask=bytes(range(32)),
        # not in row order, one with a single proposal, ids up to a large vocabulary
        scheduled_spec_decode_tokens={"c": [151_000, 0], "b": [5, 6, 7]},
    )


def test_a_plans_proposals_round_trip_in_order():
    plan = _plan_with_proposals()
    back = plan_from_pb(_wire(plan_to_pb(plan, step_id=3)))
    assert back == plan
    assert list(back.scheduled_spec_decode_tokens) == ["c", "b"]
    assert plan_from_pb(_wire(plan_to_pb(replace(plan, scheduled_spec_decode_tokens={})))) == (
        replace(plan, scheduled_spec_decode_tokens={})
    )


def test_a_results_proposals_round_trip():
    result = RunnerOutput(
        request_ids=["a", "b", "c"],
        sampled_token_ids=[[5, 6, 9], [], [1]],  # a kept 2 proposals + the target's
        logprobs={"a": [TokenLogprobs([t], [-0.5], [1]) for t in (5, 6, 9)]},
        spec_token_ids={"c": [4, 4, 4, 4], "a": [2]},
    )
    back = result_from_pb(_wire(result_to_pb(result)))
    assert back == result
    assert list(back.spec_token_ids) == ["c", "a"]


@pytest.mark.parametrize(
    ("field", "values", "match"),
    [
        ("num_spec_tokens", [2], "spec_request_ids and num_spec_tokens"),
        ("num_spec_tokens", [9, 1], "spec_token_ids"),
    ],
)
def test_malformed_spec_columns_raise_value_errors(field, values, match):
    plan_message = plan_to_pb(_plan_with_proposals())
    result_message = result_to_pb(RunnerOutput(["a"], [[1]], spec_token_ids={"a": [1], "b": [2]}))
    for message, parse in ((plan_message, plan_from_pb), (result_message, result_from_pb)):
        message.ClearField(field)
        getattr(message, field).extend(values)
        with pytest.raises(ValueError, match=match):
            parse(message)


def test_spec_decode_stats_round_trip_and_add_up():
    stats = SchedulerStats(
        num_running_reqs=2,
        spec_decode_num_drafts=5,
        spec_decode_num_draft_tokens=14,
        spec_decode_num_accepted_tokens=7,
        spec_decode_num_accepted_tokens_per_pos=(4, 2, 1, 0),
    )
    back = stats_from_pb(_wire(stats_to_pb(stats)))
    assert back == stats
    assert isinstance(back.spec_decode_num_accepted_tokens_per_pos, tuple)
    other = SchedulerStats(
        kv_cache_usage=0.5,
        spec_decode_num_drafts=1,
        spec_decode_num_draft_tokens=2,
        spec_decode_num_accepted_tokens=2,
        spec_decode_num_accepted_tokens_per_pos=(1, 1),
    )
    total = add_stats([stats, other])
    assert total.spec_decode_num_drafts == 6 and total.spec_decode_num_draft_tokens == 16
    assert total.spec_decode_num_accepted_tokens == 9
    assert total.spec_decode_num_accepted_tokens_per_pos == (5, 3, 1, 0)
    assert total.kv_cache_usage == 0.25 and total.num_running_reqs == 2


def test_the_model_descriptions_carry_the_speculation():
    speculative = SpeculativeConfig("draft_model", 3, model="/m/draft")
    model = ModelInfo(
        "m", "LlamaForCausalLM", "float32", "cpu", 2, 4, 64, 512, (2,), 256,
        capabilities=ModelCapabilities(speculative=speculative),
    )  # fmt: skip
    back = worker_description_from_pb(_wire(worker_description_to_pb(model)))
    assert back == model and back.capabilities.speculative == speculative
    info = ServedModelInfo(
        "tiny", 256, 512, (2, 3), 16, "LlamaForCausalLM", "float32", 1024,
        capabilities=ModelCapabilities(speculative=speculative),
    )  # fmt: skip
    message = _wire(served_model_info_to_pb(info))
    assert message.speculative_decoding == "draft_model k=3"
    assert message.capabilities.speculative.model == "/m/draft"
    assert served_model_info_from_pb(message) == info
