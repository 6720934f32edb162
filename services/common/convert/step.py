"""SchedulerOutput <-> StepPlan and RunnerOutput <-> StepResult (worker.proto's columns).

The row order of num_scheduled_tokens (the order the worker lays out the batch in) is
the order of scheduled_request_ids. A block table (per KV cache group) travels flat,
position-major, here only. plan_from_pb is where a plan from the wire is checked, once:
a malformed message, or one past the worker's PlanLimits, raises ValueError naming the field.
"""

from __future__ import annotations

from itertools import islice

from services.common.convert.image import images_from_pb, images_to_pb
from services.common.convert.logprobs import fill_logprobs, logprobs_from_pb
from services.common.convert.lora import lora_columns_from_pb, lora_columns_to_pb
from services.common.convert.plan_limits import KV_KEY_BYTES, KV_TIERS, PlanLimits
from services.common.convert.pooling import (
    pooled_from_bytes,
    pooled_to_bytes,
    pooling_params_from_pb,
    pooling_params_to_pb,
)
from services.common.convert.sampling import sampling_params_from_pb, sampling_params_to_pb
from services.common.image_input import check_images
from services.common.pooling_params import PoolingParams
from services.common.proto.pagestream.internal.v1 import worker_pb2
from services.common.runner_output import RunnerOutput, StepTimings
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import (
    BlockTable,
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)


def _flatten(pairs: list[tuple[int, int]]) -> list[int]:
    return [i for pair in pairs for i in pair]


def _pairs(name: str, flat) -> list[tuple[int, int]]:
    if len(flat) % 2:
        raise ValueError(f"{name} must hold (src, dst) pairs, got {len(flat)} ids")
    return list(zip(flat[::2], flat[1::2], strict=True))


def _split(name: str, flat, counts) -> list[list[int]]:
    """Cut a flattened column into pieces of the given sizes."""
    flat, counts = list(flat), list(counts)
    if sum(counts) != len(flat) or (counts and min(counts) < 0):
        raise ValueError(f"{name}: the counts do not add up to the {len(flat)} values given")
    if not flat:
        return [[] for _ in counts]
    if len(flat) == len(counts) and max(counts) == 1:  # one each: decode steps
        return [[value] for value in flat]
    values = iter(flat)
    return [list(islice(values, count)) if count else [] for count in counts]


def _keyed_lists_to_pb(spec_tokens: dict[str, list[int]]) -> dict:
    """Speculative tokens per request as the spec_* columns of a StepPlan / StepResult."""
    return {
        "spec_request_ids": list(spec_tokens),
        "num_spec_tokens": [len(ids) for ids in spec_tokens.values()],
        "spec_token_ids": [i for ids in spec_tokens.values() for i in ids],
    }


def _keyed_lists_from_pb(message) -> dict[str, list[int]]:
    request_ids = list(message.spec_request_ids)
    if len(request_ids) != len(message.num_spec_tokens):
        raise ValueError("spec_request_ids and num_spec_tokens differ in length")
    pieces = _split("spec_token_ids", message.spec_token_ids, message.num_spec_tokens)
    return dict(zip(request_ids, pieces, strict=True))


def _flat_table(table: BlockTable) -> list[int]:
    """Position-major: position p's id of every group, then position p + 1's."""
    return [i for row in zip(*table, strict=True) for i in row]


def _table(name: str, flat, num_groups: int) -> BlockTable:
    flat = list(flat)
    if len(flat) % num_groups:
        raise ValueError(f"{name}: {len(flat)} ids do not fill {num_groups} KV cache groups")
    return tuple(list(flat[g::num_groups]) for g in range(num_groups))


def _num_kv_groups(plan: SchedulerOutput) -> int | None:
    """The groups every table of the plan holds (None: it has none)."""
    tables = [n.block_table for n in plan.scheduled_new_reqs]
    tables += plan.scheduled_cached_reqs.new_block_ids
    counts = {len(table) for table in tables}
    if len(counts) > 1:
        raise ValueError(f"the plan's block tables hold different KV cache groups: {counts}")
    return counts.pop() if counts else None


def _kv_offload_to_pb(plan: SchedulerOutput) -> dict:
    """The plan's kv_drops / kv_loads / kv_saves as StepPlan's parallel kv_* columns."""
    return {
        "kv_drop_keys": [key for key, _ in plan.kv_drops],
        "kv_drop_tiers": [tier for _, tier in plan.kv_drops],
        "kv_load_keys": [key for key, _ in plan.kv_loads],
        "kv_load_blocks": [block for _, block in plan.kv_loads],
        "kv_save_blocks": [block for block, _ in plan.kv_saves],
        "kv_save_keys": [key for _, key in plan.kv_saves],
    }


def _kv_offload_from_pb(message: worker_pb2.StepPlan) -> dict:
    """kv_drops, kv_loads, kv_saves from the columns; every key 32 bytes, every tier named."""
    columns = {
        "kv_drops": ("kv_drop_keys", "kv_drop_tiers"),
        "kv_loads": ("kv_load_keys", "kv_load_blocks"),
        "kv_saves": ("kv_save_blocks", "kv_save_keys"),
    }
    fields = {}
    for name, (first, second) in columns.items():
        left, right = list(getattr(message, first)), list(getattr(message, second))
        if len(left) != len(right):
            raise ValueError(f"{first} and {second} differ in length")
        fields[name] = list(zip(left, right, strict=True))
    keys = [*message.kv_drop_keys, *message.kv_load_keys, *message.kv_save_keys]
    if any(len(key) != KV_KEY_BYTES for key in keys):
        raise ValueError(f"kv_*_keys: a KV offload key must be {KV_KEY_BYTES} bytes (a block hash)")
    if unknown := set(message.kv_drop_tiers) - set(KV_TIERS):
        raise ValueError(f"kv_drop_tiers: {sorted(unknown)[0]!r} is not one of {KV_TIERS}")
    return fields


def _new_request_to_pb(new: NewRequestData) -> worker_pb2.NewRequest:
    kind = {}
    match new.kind:
        case SamplingParams() as params:
            kind["sampling_params"] = sampling_params_to_pb(params)
            # The worker only sees the per-step masks: the grammar, the thinking's bounds
            # and its budget are the scheduler's (a forced end is a mask row like a grammar's).
            for name in ("structured_outputs", "reasoning", "thinking_token_budget"):
                kind["sampling_params"].ClearField(name)
        case PoolingParams() as params:
            kind["pooling_params"] = pooling_params_to_pb(params)
    return worker_pb2.NewRequest(
        request_id=new.request_id,
        prompt_token_ids=new.prompt_token_ids,
        output_token_ids=new.output_token_ids,
        block_ids=_flat_table(new.block_table),
        num_computed_tokens=new.num_computed_tokens,
        images=images_to_pb(new.images),
        **kind,
    )


def _new_request_from_pb(message: worker_pb2.NewRequest, num_groups: int) -> NewRequestData:
    name = f"new request {message.request_id!r}"
    match message.WhichOneof("kind"):
        case "sampling_params":
            kind = sampling_params_from_pb(message.sampling_params)
        case "pooling_params":
            kind = pooling_params_from_pb(message.pooling_params)
        case _:
            raise ValueError(f"{name}: one of sampling_params and pooling_params, got neither")
    num_tokens = len(message.prompt_token_ids) + len(message.output_token_ids)
    if not message.prompt_token_ids:
        raise ValueError(f"{name}: prompt_token_ids is empty")
    if not 0 <= message.num_computed_tokens <= num_tokens:
        raise ValueError(
            f"{name}: num_computed_tokens {message.num_computed_tokens} outside 0..{num_tokens}"
        )
    images = images_from_pb(message.images)
    try:
        check_images(images, len(message.prompt_token_ids))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return NewRequestData(
        request_id=message.request_id,
        prompt_token_ids=list(message.prompt_token_ids),
        output_token_ids=list(message.output_token_ids),
        kind=kind,
        block_table=_table(f"block_ids of {name}", message.block_ids, num_groups),
        num_computed_tokens=message.num_computed_tokens,
        images=images,
    )


def plan_to_pb(plan: SchedulerOutput, step_id: int = 0) -> worker_pb2.StepPlan:
    cached = plan.scheduled_cached_reqs
    flat_new_blocks = [_flat_table(table) for table in cached.new_block_ids]
    return worker_pb2.StepPlan(
        step_id=step_id,
        new_requests=[_new_request_to_pb(new) for new in plan.scheduled_new_reqs],
        cached_request_ids=cached.request_ids,
        cached_num_new_blocks=[len(ids) for ids in flat_new_blocks],
        cached_new_block_ids=[i for ids in flat_new_blocks for i in ids],
        cached_num_computed_tokens=cached.num_computed_tokens,
        cached_resumed=cached.resumed_from_preemption,
        scheduled_request_ids=plan.num_scheduled_tokens.keys(),
        num_scheduled_tokens=plan.num_scheduled_tokens.values(),
        finished_request_ids=sorted(plan.finished_req_ids),
        blocks_to_copy=_flatten(plan.blocks_to_copy),
        blocks_to_swap_in=_flatten(plan.blocks_to_swap_in),
        blocks_to_swap_out=_flatten(plan.blocks_to_swap_out),
        cached_num_new_tokens=[len(ids) for ids in cached.new_token_ids],
        cached_new_token_ids=[i for ids in cached.new_token_ids for i in ids],
        grammar_request_ids=plan.grammar_request_ids,
        grammar_bitmask=plan.grammar_bitmask,
        num_kv_groups=_num_kv_groups(plan),
        **_kv_offload_to_pb(plan),
        **_keyed_lists_to_pb(plan.scheduled_spec_decode_tokens),
        **lora_columns_to_pb(plan.lora_slots, plan.lora_adapters),
    )


def plan_from_pb(message: worker_pb2.StepPlan, limits: PlanLimits | None = None) -> SchedulerOutput:
    """The plan, checked (against `limits` too when given: the worker's)."""
    plan = _plan_from_pb(message)
    if limits is not None:
        limits.check(plan)
    return plan


def _plan_from_pb(message: worker_pb2.StepPlan) -> SchedulerOutput:
    request_ids = list(message.cached_request_ids)
    columns = (message.cached_num_computed_tokens, message.cached_resumed)
    if any(len(column) != len(request_ids) for column in columns):
        raise ValueError("the cached_* columns of the StepPlan differ in length")
    scheduled = list(message.scheduled_request_ids)
    num_scheduled = list(message.num_scheduled_tokens)
    if len(scheduled) != len(num_scheduled):
        raise ValueError("scheduled_request_ids and num_scheduled_tokens differ in length")
    if num_scheduled and min(num_scheduled) < 1:
        row = next(i for i, n in enumerate(num_scheduled) if n < 1)
        raise ValueError(
            f"num_scheduled_tokens: request {scheduled[row]!r} schedules fewer than 1 token"
        )
    num_groups = message.num_kv_groups if message.HasField("num_kv_groups") else 1
    if num_groups < 1:
        raise ValueError(f"num_kv_groups must be >= 1, got {num_groups}")
    new_blocks = _split(
        "cached_new_block_ids", message.cached_new_block_ids, message.cached_num_new_blocks
    )
    cached = CachedRequestData(
        request_ids=request_ids,
        new_block_ids=[
            _table(f"cached_new_block_ids of {rid!r}", ids, num_groups)
            for rid, ids in zip(request_ids, new_blocks, strict=False)
        ],
        num_computed_tokens=list(message.cached_num_computed_tokens),
        resumed_from_preemption=list(message.cached_resumed),
        new_token_ids=_split(
            "cached_new_token_ids", message.cached_new_token_ids, message.cached_num_new_tokens
        ),
    )
    if len(new_blocks) != len(request_ids):
        raise ValueError("cached_num_new_blocks and cached_request_ids differ in length")
    if cached.new_token_ids and len(cached.new_token_ids) != len(request_ids):
        raise ValueError("cached_num_new_tokens and cached_request_ids differ in length")
    spec_tokens = _keyed_lists_from_pb(message)
    if unscheduled := [rid for rid in spec_tokens if rid not in scheduled]:
        raise ValueError(
            f"spec_request_ids: proposals for {unscheduled[0]!r}, which is not scheduled"
        )
    lora_slots, lora_adapters = lora_columns_from_pb(message)
    return SchedulerOutput(
        scheduled_new_reqs=[_new_request_from_pb(new, num_groups) for new in message.new_requests],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict(zip(scheduled, num_scheduled, strict=True)),
        total_num_scheduled_tokens=sum(num_scheduled),
        finished_req_ids=set(message.finished_request_ids),
        blocks_to_copy=_pairs("blocks_to_copy", message.blocks_to_copy),
        blocks_to_swap_in=_pairs("blocks_to_swap_in", message.blocks_to_swap_in),
        blocks_to_swap_out=_pairs("blocks_to_swap_out", message.blocks_to_swap_out),
        grammar_request_ids=list(message.grammar_request_ids),
        grammar_bitmask=message.grammar_bitmask,
        scheduled_spec_decode_tokens=spec_tokens,
        lora_slots=lora_slots,
        lora_adapters=lora_adapters,
        **_kv_offload_from_pb(message),
    )


def result_to_pb(result: RunnerOutput, step_id: int = 0, error: str = "") -> worker_pb2.StepResult:
    timings = result.timings
    message = worker_pb2.StepResult(
        step_id=step_id,
        request_ids=result.request_ids,
        num_sampled=[len(ids) for ids in result.sampled_token_ids],
        sampled_token_ids=[i for ids in result.sampled_token_ids for i in ids],
        prepare_s=timings.prepare_s,
        forward_s=timings.forward_s,
        sample_s=timings.sample_s,
        error=error or None,
        request_errors=result.request_errors,
        **_keyed_lists_to_pb(result.spec_token_ids),
        pooled={rid: pooled_to_bytes(p) for rid, p in result.pooled.items()},
        kv_load_failures=result.kv_load_failures,
    )
    for rid, positions in result.logprobs.items():  # built in place: no copies
        fill_logprobs(message.logprobs[rid], positions)
    for rid, positions in result.prompt_logprobs.items():
        fill_logprobs(message.prompt_logprobs[rid], positions)
    return message


def result_from_pb(message: worker_pb2.StepResult) -> RunnerOutput:
    """The RunnerOutput (the caller checks `message.error` first)."""
    request_ids = list(message.request_ids)
    sampled = _split("sampled_token_ids", message.sampled_token_ids, message.num_sampled)
    if len(sampled) != len(request_ids):
        raise ValueError("request_ids and num_sampled differ in length")
    return RunnerOutput(
        request_ids=request_ids,
        sampled_token_ids=sampled,
        logprobs={rid: logprobs_from_pb(m) for rid, m in message.logprobs.items()},
        prompt_logprobs={rid: logprobs_from_pb(m) for rid, m in message.prompt_logprobs.items()},
        timings=StepTimings(message.prepare_s, message.forward_s, message.sample_s),
        spec_token_ids=_keyed_lists_from_pb(message),
        request_errors=dict(message.request_errors),
        pooled={rid: pooled_from_bytes(data) for rid, data in message.pooled.items()},
        kv_load_failures=list(message.kv_load_failures),
    )
