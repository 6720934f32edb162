"""SamplingParams <-> pagestream.v1.SamplingParams, honouring field presence.

An unset field means vLLM's default, so only values that differ from the default are
written. Floats travel as float32 and come back as the shortest decimal that maps to the
same float32 (0.7 stays 0.7). `max_tokens=None` (no limit but max_model_len) travels as
INT32_MAX, which means the same thing. `output_kind` is a frontend setting and does not
travel. Invalid values raise ValueError naming the field (SamplingParams' own checks).
"""

from __future__ import annotations

import json
import math
import struct

from services.common.proto.pagestream.v1 import generation_pb2
from services.common.reasoning_bounds import ReasoningBounds
from services.common.sampling_defaults import sampling_params_with_defaults
from services.common.sampling_params import INT32_MAX, SamplingParams
from services.common.structured_outputs import StructuredOutputsParams

_DEFAULTS = SamplingParams()
_INT_FIELDS = (
    "n",
    "top_k",
    "seed",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "thinking_token_budget",
)
_FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
    "length_penalty",
)
_BOOL_FIELDS = (
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "use_beam_search",
)


def shortest_float32(value: float) -> float:
    """The shortest decimal whose float32 equals float32(value)."""
    if not math.isfinite(value):
        return value
    packed = struct.pack("<f", value)
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return struct.unpack("<f", packed)[0]


def _set(message, name: str, value) -> None:
    try:
        setattr(message, name, value)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"{name} cannot be sent: {value!r} ({exc}).") from exc


def sampling_params_to_pb(params: SamplingParams) -> generation_pb2.SamplingParams:
    message = generation_pb2.SamplingParams()
    for name in (*_INT_FIELDS, *_FLOAT_FIELDS, *_BOOL_FIELDS):
        value = getattr(params, name)
        if value is not None and value != getattr(_DEFAULTS, name):
            _set(message, name, value)
    if params.max_tokens != _DEFAULTS.max_tokens:
        _set(message, "max_tokens", INT32_MAX if params.max_tokens is None else params.max_tokens)
    if params.stop:
        message.stop.extend(params.stop)
    if params.stop_token_ids:
        try:
            message.stop_token_ids.extend(params.stop_token_ids)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"stop_token_ids cannot be sent: {exc}.") from exc
    for token_id, bias in (params.logit_bias or {}).items():
        try:
            message.logit_bias[token_id] = bias
        except (ValueError, TypeError) as exc:
            raise ValueError(f"logit_bias cannot be sent: {token_id!r} ({exc}).") from exc
    if params.structured_outputs is not None:
        message.structured_outputs.CopyFrom(structured_outputs_to_pb(params.structured_outputs))
    if params.reasoning is not None:
        message.reasoning.CopyFrom(reasoning_bounds_to_pb(params.reasoning))
    return message


def reasoning_bounds_to_pb(bounds: ReasoningBounds) -> generation_pb2.ReasoningBounds:
    try:
        return generation_pb2.ReasoningBounds(
            mode=int(bounds.mode),
            start_token_ids=bounds.start_token_ids,
            end_token_ids=bounds.end_token_ids,
            forced_end_token_ids=bounds.forced_end_token_ids,
        )
    except (ValueError, TypeError) as exc:
        raise ValueError(f"reasoning cannot be sent: {exc}.") from exc


def reasoning_bounds_from_pb(message: generation_pb2.ReasoningBounds) -> ReasoningBounds:
    """Raises ValueError naming the problem (an unknown mode, too many ids, ...)."""
    return ReasoningBounds(
        mode=message.mode,
        start_token_ids=tuple(message.start_token_ids),
        end_token_ids=tuple(message.end_token_ids),
        forced_end_token_ids=tuple(message.forced_end_token_ids),
    )


def structured_outputs_to_pb(params: StructuredOutputsParams) -> generation_pb2.StructuredOutputs:
    message = generation_pb2.StructuredOutputs(
        disable_any_whitespace=params.disable_any_whitespace,
        disable_additional_properties=params.disable_additional_properties,
    )
    kind = params.kind
    if kind == "json":
        schema = params.json
        message.json = schema if isinstance(schema, str) else json.dumps(schema)
    elif kind == "choice":
        message.choice.choices.extend(params.choice)
    elif kind == "json_object":
        message.json_object = True
    else:
        setattr(message, kind, getattr(params, kind))
    if params.whitespace_pattern is not None:
        message.whitespace_pattern = params.whitespace_pattern
    return message


def structured_outputs_from_pb(
    message: generation_pb2.StructuredOutputs,
) -> StructuredOutputsParams:
    """Raises ValueError naming the problem (no constraint set, bad JSON, ...)."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise ValueError(
            "structured_outputs needs one of json, regex, choice, grammar, json_object."
        )
    value = list(message.choice.choices) if kind == "choice" else getattr(message, kind)
    options = {}
    if message.HasField("whitespace_pattern"):
        options["whitespace_pattern"] = message.whitespace_pattern
    return StructuredOutputsParams(
        **{kind: value},
        disable_any_whitespace=message.disable_any_whitespace,
        disable_additional_properties=message.disable_additional_properties,
        **options,
    )


def _float(name: str, value: float) -> float:
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got nan.")
    return shortest_float32(value)


def sampling_params_from_pb(
    message: generation_pb2.SamplingParams, defaults: dict | None = None
) -> SamplingParams:
    """The domain params; unset fields take `defaults`, else vLLM's. Raises ValueError."""
    kwargs: dict = {}
    for name in (*_INT_FIELDS, *_BOOL_FIELDS):
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    for name in _FLOAT_FIELDS:
        if message.HasField(name):
            kwargs[name] = _float(name, getattr(message, name))
    if message.HasField("max_tokens"):
        max_tokens = message.max_tokens
        kwargs["max_tokens"] = None if max_tokens == INT32_MAX else max_tokens
    if message.stop:
        kwargs["stop"] = list(message.stop)
    if message.stop_token_ids:
        kwargs["stop_token_ids"] = list(message.stop_token_ids)
    if message.logit_bias:
        kwargs["logit_bias"] = {
            token_id: _float("logit_bias values", bias)
            for token_id, bias in message.logit_bias.items()
        }
    if message.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_pb(message.structured_outputs)
    if message.HasField("reasoning"):
        kwargs["reasoning"] = reasoning_bounds_from_pb(message.reasoning)
    return sampling_params_with_defaults(kwargs, defaults)
