"""engine.proto <-> domain: AddRequest, EngineOutputBatch, SchedulerStats, model info.

EngineOutputBatch is columnar: entry i of every per-output column belongs to output i.
Sentinels are the proto's own: "" for no parent / no finish reason / no error, -1 for a
stop reason that is not a token id (string stop reasons are set by frontends and never
travel), NaN for no cumulative logprob, 0 logprob positions for no logprobs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import fields

from services.common.convert.capabilities import capabilities_from_pb, capabilities_to_pb
from services.common.convert.logprobs import pack_logprobs, unpack_logprobs
from services.common.convert.lora import lora_from_pb, lora_to_pb
from services.common.convert.pooling import (
    pooled_from_bytes,
    pooled_to_bytes,
    pooling_params_from_pb,
    pooling_params_to_pb,
)
from services.common.convert.sampling import sampling_params_from_pb, sampling_params_to_pb
from services.common.engine_output import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from services.common.engine_request import EngineCoreRequest
from services.common.proto.pagestream.internal.v1 import engine_pb2
from services.common.proto.pagestream.v1 import generation_pb2
from services.common.served_model_info import ServedModelInfo

_NO_STOP_TOKEN = -1
_STATS_FIELDS = tuple(f.name for f in fields(SchedulerStats))


# ---- requests -------------------------------------------------------------------------
def engine_request_to_pb(request: EngineCoreRequest) -> engine_pb2.AddRequest:
    sampling, pooling = request.sampling_params, request.pooling_params
    return engine_pb2.AddRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=sampling_params_to_pb(sampling) if sampling is not None else None,
        eos_token_id=request.eos_token_id,
        extra_stop_token_ids=request.extra_stop_token_ids,
        priority=request.priority,
        cache_salt=request.cache_salt or "",
        lora=lora_to_pb(request.lora_request) if request.lora_request else None,
        pooling_params=pooling_params_to_pb(pooling) if pooling is not None else None,
    )


def engine_request_from_pb(message: engine_pb2.AddRequest) -> EngineCoreRequest:
    """Raises ValueError (naming the field) on invalid params, or unless exactly one of
    sampling_params and pooling_params is set."""
    if not message.request_id:
        raise ValueError("request_id must not be empty.")
    return EngineCoreRequest(
        request_id=message.request_id,
        prompt_token_ids=list(message.prompt_token_ids),
        sampling_params=sampling_params_from_pb(message.sampling_params)
        if message.HasField("sampling_params")
        else None,
        eos_token_id=message.eos_token_id if message.HasField("eos_token_id") else None,
        extra_stop_token_ids=tuple(message.extra_stop_token_ids),
        priority=message.priority,
        cache_salt=message.cache_salt or None,
        lora_request=lora_from_pb(message.lora) if message.HasField("lora") else None,
        pooling_params=pooling_params_from_pb(message.pooling_params)
        if message.HasField("pooling_params")
        else None,
    )


# ---- outputs --------------------------------------------------------------------------
def _stop_token(output: EngineCoreOutput) -> int:
    reason = output.stop_reason
    return reason if isinstance(reason, int) else _NO_STOP_TOKEN


def outputs_to_pb(batch: EngineCoreOutputs) -> engine_pb2.EngineOutputBatch:
    outputs = batch.outputs
    message = engine_pb2.EngineOutputBatch(
        request_ids=[o.request_id for o in outputs],
        parent_request_ids=[o.parent_request_id or "" for o in outputs],
        indices=[o.index for o in outputs],
        num_new_tokens=[len(o.new_token_ids) for o in outputs],
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
        finish_reasons=[o.finish_reason or "" for o in outputs],
        stop_token_ids=[_stop_token(o) for o in outputs],
        num_cached_tokens=[o.num_cached_tokens for o in outputs],
        cumulative_logprobs=[
            math.nan if o.cumulative_logprob is None else o.cumulative_logprob for o in outputs
        ],
        errors=[o.error or "" for o in outputs],
        error_codes=[o.error_code or "" for o in outputs]
        if any(o.error_code for o in outputs)
        else [],
        queued_s=[math.nan if o.queued_s is None else o.queued_s for o in outputs],
        pooled=[pooled_to_bytes(o.pooled) for o in outputs]
        if any(o.pooled is not None for o in outputs)
        else [],
    )
    pack_logprobs(message, "", (o.new_logprobs for o in outputs))
    pack_logprobs(message, "prompt_", (o.new_prompt_logprobs for o in outputs))
    if batch.scheduler_stats is not None:
        message.stats.CopyFrom(stats_to_pb(batch.scheduler_stats))
    return message


def _check_columns(message: engine_pb2.EngineOutputBatch) -> int:
    count = len(message.request_ids)
    columns = (
        "parent_request_ids",
        "indices",
        "num_new_tokens",
        "finish_reasons",
        "stop_token_ids",
        "num_cached_tokens",
        "cumulative_logprobs",
        "errors",
        "queued_s",
        "num_logprob_positions",
        "num_prompt_logprob_positions",
    )
    for name in columns:
        if len(getattr(message, name)) != count:
            raise ValueError(
                f"EngineOutputBatch.{name} has {len(getattr(message, name))} "
                f"entries for {count} outputs"
            )
    for name in ("error_codes", "pooled"):
        if getattr(message, name) and len(getattr(message, name)) != count:
            raise ValueError(f"EngineOutputBatch.{name} must be empty or one per output")
    if sum(message.num_new_tokens) != len(message.new_token_ids):
        raise ValueError("EngineOutputBatch.num_new_tokens does not match new_token_ids")
    return count


def outputs_from_pb(message: engine_pb2.EngineOutputBatch) -> EngineCoreOutputs:
    count = _check_columns(message)
    new_token_ids = list(message.new_token_ids)
    logprobs = unpack_logprobs(message, "")
    prompt_logprobs = unpack_logprobs(message, "prompt_")
    outputs, start = [], 0
    for i in range(count):
        end = start + message.num_new_tokens[i]
        stop_token, cumulative = message.stop_token_ids[i], message.cumulative_logprobs[i]
        outputs.append(
            EngineCoreOutput(
                request_id=message.request_ids[i],
                new_token_ids=new_token_ids[start:end],
                finish_reason=message.finish_reasons[i] or None,
                stop_reason=None if stop_token == _NO_STOP_TOKEN else stop_token,
                new_logprobs=logprobs[i] or None,
                new_prompt_logprobs=prompt_logprobs[i] or None,
                num_cached_tokens=message.num_cached_tokens[i],
                parent_request_id=message.parent_request_ids[i] or None,
                index=message.indices[i],
                error=message.errors[i] or None,
                error_code=(message.error_codes[i] or None) if message.error_codes else None,
                cumulative_logprob=None if math.isnan(cumulative) else cumulative,
                queued_s=None if math.isnan(message.queued_s[i]) else message.queued_s[i],
                pooled=pooled_from_bytes(message.pooled[i]) if message.pooled else None,
            )
        )
        start = end
    stats = stats_from_pb(message.stats) if message.HasField("stats") else None
    return EngineCoreOutputs(outputs, stats)


# ---- stats and model info ---------------------------------------------------------------
def stats_to_pb(stats: SchedulerStats) -> engine_pb2.SchedulerStats:
    return engine_pb2.SchedulerStats(**{name: getattr(stats, name) for name in _STATS_FIELDS})


def stats_from_pb(message: engine_pb2.SchedulerStats) -> SchedulerStats:
    stats = SchedulerStats(**{name: getattr(message, name) for name in _STATS_FIELDS})
    repeated = (  # repeated fields come as lists
        "spec_decode_num_accepted_tokens_per_pos",
        "running_lora_adapters",
        "waiting_lora_adapters",
    )
    return dataclasses.replace(stats, **{name: tuple(getattr(stats, name)) for name in repeated})


def served_model_info_to_pb(info: ServedModelInfo) -> generation_pb2.ModelInfo:
    return generation_pb2.ModelInfo(
        model=info.model,
        architecture=info.architecture,
        dtype=info.dtype,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        block_size=info.block_size,
        num_gpu_blocks=info.num_gpu_blocks,
        quantization=info.quantization,
        weight_bytes=info.weight_bytes,
        speculative_decoding=info.speculative_decoding,
        runner=info.runner,
        capabilities=capabilities_to_pb(info.capabilities),
    )


def served_model_info_from_pb(message: generation_pb2.ModelInfo) -> ServedModelInfo:
    return ServedModelInfo(
        model=message.model,
        max_model_len=message.max_model_len,
        vocab_size=message.vocab_size,
        eos_token_ids=tuple(message.eos_token_ids),
        block_size=message.block_size,
        architecture=message.architecture,
        dtype=message.dtype,
        num_gpu_blocks=message.num_gpu_blocks,
        quantization=message.quantization or "none",
        weight_bytes=message.weight_bytes,
        capabilities=capabilities_from_pb(message.capabilities),
    )


def engine_info_to_pb(
    info: ServedModelInfo, max_num_seqs: int, max_num_batched_tokens: int, num_cpu_blocks: int
) -> engine_pb2.EngineInfo:
    return engine_pb2.EngineInfo(
        model=served_model_info_to_pb(info),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_cpu_blocks=num_cpu_blocks,
    )
