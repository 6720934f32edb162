"""engine.proto <-> domain: AddRequest, EngineOutputBatch, SchedulerStats, model info.

Absence travels as proto3 presence (an unset optional field or message is None); string
stop reasons are set by frontends and never travel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields

from services.common.convert.capabilities import capabilities_from_pb, capabilities_to_pb
from services.common.convert.engine_error import engine_error_from_pb, engine_error_to_pb
from services.common.convert.finish_reason import finish_reason_from_pb, finish_reason_to_pb
from services.common.convert.image import images_from_pb, images_to_pb
from services.common.convert.logprobs import fill_logprobs, logprobs_from_pb
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
        cache_salt=request.cache_salt or None,
        lora=lora_to_pb(request.lora_request) if request.lora_request else None,
        pooling_params=pooling_params_to_pb(pooling) if pooling is not None else None,
        images=images_to_pb(request.images),
    )


def engine_request_from_pb(message: engine_pb2.AddRequest) -> EngineCoreRequest:
    """Raises ValueError (naming the field) on invalid params, or when the request's kind
    (sampling_params or pooling_params) is unset."""
    if not message.request_id:
        raise ValueError("request_id must not be empty.")
    kind = message.WhichOneof("kind")
    return EngineCoreRequest(
        request_id=message.request_id,
        prompt_token_ids=list(message.prompt_token_ids),
        sampling_params=sampling_params_from_pb(message.sampling_params)
        if kind == "sampling_params"
        else None,
        eos_token_id=message.eos_token_id if message.HasField("eos_token_id") else None,
        extra_stop_token_ids=tuple(message.extra_stop_token_ids),
        priority=message.priority,
        cache_salt=message.cache_salt if message.HasField("cache_salt") else None,
        lora_request=lora_from_pb(message.lora) if message.HasField("lora") else None,
        pooling_params=pooling_params_from_pb(message.pooling_params)
        if kind == "pooling_params"
        else None,
        images=images_from_pb(message.images),
    )


# ---- outputs --------------------------------------------------------------------------
def _output_to_pb(output: EngineCoreOutput) -> engine_pb2.EngineOutput:
    stop = output.stop_reason
    message = engine_pb2.EngineOutput(
        request_id=output.request_id,
        parent_request_id=output.parent_request_id,
        index=output.index,
        new_token_ids=output.new_token_ids,
        finish_reason=finish_reason_to_pb(output.finish_reason),
        stop_token_id=stop if isinstance(stop, int) else None,
        num_cached_tokens=output.num_cached_tokens,
        cumulative_logprob=output.cumulative_logprob,
        error=engine_error_to_pb(output.error, output.error_code),
        queued_s=output.queued_s,
        pooled=pooled_to_bytes(output.pooled) if output.pooled is not None else None,
    )
    if output.new_logprobs:
        fill_logprobs(message.logprobs, output.new_logprobs)
    if output.new_prompt_logprobs:
        fill_logprobs(message.prompt_logprobs, output.new_prompt_logprobs)
    return message


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


def _output_from_pb(message: engine_pb2.EngineOutput) -> EngineCoreOutput:
    error, error_code = (
        engine_error_from_pb(message.error) if message.HasField("error") else (None, None)
    )
    return EngineCoreOutput(
        request_id=message.request_id,
        new_token_ids=list(message.new_token_ids),
        finish_reason=finish_reason_from_pb(message.finish_reason),
        stop_reason=_optional(message, "stop_token_id"),
        new_logprobs=logprobs_from_pb(message.logprobs) if message.HasField("logprobs") else None,
        new_prompt_logprobs=logprobs_from_pb(message.prompt_logprobs)
        if message.HasField("prompt_logprobs")
        else None,
        num_cached_tokens=message.num_cached_tokens,
        parent_request_id=_optional(message, "parent_request_id"),
        index=message.index,
        error=error,
        error_code=error_code,
        cumulative_logprob=_optional(message, "cumulative_logprob"),
        queued_s=_optional(message, "queued_s"),
        pooled=pooled_from_bytes(message.pooled) if message.HasField("pooled") else None,
    )


def outputs_to_pb(batch: EngineCoreOutputs) -> engine_pb2.EngineOutputBatch:
    message = engine_pb2.EngineOutputBatch(outputs=[_output_to_pb(o) for o in batch.outputs])
    if batch.scheduler_stats is not None:
        message.stats.CopyFrom(stats_to_pb(batch.scheduler_stats))
    return message


def outputs_from_pb(message: engine_pb2.EngineOutputBatch) -> EngineCoreOutputs:
    """Raises ValueError on a malformed logprobs position or pooled state, or an enum
    value this side does not know."""
    outputs = [_output_from_pb(o) for o in message.outputs]
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
        num_gpu_blocks=info.num_device_blocks,
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
        num_device_blocks=message.num_gpu_blocks,
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
