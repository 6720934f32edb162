from services.common.proto.pagestream.internal.v1 import image_pb2 as _image_pb2
from services.common.proto.pagestream.internal.v1 import logprobs_pb2 as _logprobs_pb2
from services.common.proto.pagestream.internal.v1 import lora_pb2 as _lora_pb2
from services.common.proto.pagestream.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_NONE: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
FINISH_REASON_NONE: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode

class AddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "pooling_params", "eos_token_id", "extra_stop_token_ids", "priority", "cache_salt", "lora", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    POOLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EXTRA_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generation_pb2.SamplingParams
    pooling_params: _generation_pb2.PoolingParams
    eos_token_id: int
    extra_stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    cache_salt: str
    lora: _lora_pb2.LoRAAdapter
    images: _containers.RepeatedCompositeFieldContainer[_image_pb2.ImageInput]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., pooling_params: _Optional[_Union[_generation_pb2.PoolingParams, _Mapping]] = ..., eos_token_id: _Optional[int] = ..., extra_stop_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., lora: _Optional[_Union[_lora_pb2.LoRAAdapter, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_image_pb2.ImageInput, _Mapping]]] = ...) -> None: ...

class AbortRequests(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("add", "abort")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    add: AddRequest
    abort: AbortRequests
    def __init__(self, add: _Optional[_Union[AddRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequests, _Mapping]] = ...) -> None: ...

class EngineOutputBatch(_message.Message):
    __slots__ = ("outputs", "stats")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[EngineOutput]
    stats: SchedulerStats
    def __init__(self, outputs: _Optional[_Iterable[_Union[EngineOutput, _Mapping]]] = ..., stats: _Optional[_Union[SchedulerStats, _Mapping]] = ...) -> None: ...

class EngineError(_message.Message):
    __slots__ = ("message", "code")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    message: str
    code: ErrorCode
    def __init__(self, message: _Optional[str] = ..., code: _Optional[_Union[ErrorCode, str]] = ...) -> None: ...

class EngineOutput(_message.Message):
    __slots__ = ("request_id", "parent_request_id", "index", "new_token_ids", "finish_reason", "stop_token_id", "num_cached_tokens", "cumulative_logprob", "error", "logprobs", "prompt_logprobs", "queued_s", "pooled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    parent_request_id: str
    index: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stop_token_id: int
    num_cached_tokens: int
    cumulative_logprob: float
    error: EngineError
    logprobs: _logprobs_pb2.Logprobs
    prompt_logprobs: _logprobs_pb2.Logprobs
    queued_s: float
    pooled: bytes
    def __init__(self, request_id: _Optional[str] = ..., parent_request_id: _Optional[str] = ..., index: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., cumulative_logprob: _Optional[float] = ..., error: _Optional[_Union[EngineError, _Mapping]] = ..., logprobs: _Optional[_Union[_logprobs_pb2.Logprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_logprobs_pb2.Logprobs, _Mapping]] = ..., queued_s: _Optional[float] = ..., pooled: _Optional[bytes] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running_reqs", "num_waiting_reqs", "num_swapped_reqs", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "running_lora_adapters", "waiting_lora_adapters", "max_lora", "kv_offload_hits", "kv_offload_load_failures")
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_REQS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    num_running_reqs: int
    num_waiting_reqs: int
    num_swapped_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    running_lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    waiting_lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    max_lora: int
    kv_offload_hits: int
    kv_offload_load_failures: int
    def __init__(self, num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., num_swapped_reqs: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., running_lora_adapters: _Optional[_Iterable[str]] = ..., waiting_lora_adapters: _Optional[_Iterable[str]] = ..., max_lora: _Optional[int] = ..., kv_offload_hits: _Optional[int] = ..., kv_offload_load_failures: _Optional[int] = ...) -> None: ...

class GetEngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model", "max_num_seqs", "max_num_batched_tokens", "num_cpu_blocks")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    model: _generation_pb2.ModelInfo
    max_num_seqs: int
    max_num_batched_tokens: int
    num_cpu_blocks: int
    def __init__(self, model: _Optional[_Union[_generation_pb2.ModelInfo, _Mapping]] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ...) -> None: ...

class WatchKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("reset", "stored", "removed", "stats", "block_size", "prefix_caching", "stored_offloaded", "removed_offloaded")
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    STORED_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    stats: SchedulerStats
    block_size: int
    prefix_caching: bool
    stored_offloaded: _containers.RepeatedScalarFieldContainer[bytes]
    removed_offloaded: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, reset: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., stats: _Optional[_Union[SchedulerStats, _Mapping]] = ..., block_size: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., stored_offloaded: _Optional[_Iterable[bytes]] = ..., removed_offloaded: _Optional[_Iterable[bytes]] = ...) -> None: ...
