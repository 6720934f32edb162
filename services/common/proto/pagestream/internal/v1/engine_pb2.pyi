from services.common.proto.pagestream.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "extra_stop_token_ids", "priority", "cache_salt", "lora", "pooling_params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EXTRA_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    POOLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generation_pb2.SamplingParams
    eos_token_id: int
    extra_stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    cache_salt: str
    lora: _generation_pb2.LoRAAdapter
    pooling_params: _generation_pb2.PoolingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., eos_token_id: _Optional[int] = ..., extra_stop_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., lora: _Optional[_Union[_generation_pb2.LoRAAdapter, _Mapping]] = ..., pooling_params: _Optional[_Union[_generation_pb2.PoolingParams, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("request_ids", "parent_request_ids", "indices", "num_new_tokens", "new_token_ids", "finish_reasons", "stop_token_ids", "num_cached_tokens", "cumulative_logprobs", "errors", "num_logprob_positions", "num_logprob_entries", "logprob_token_ids", "logprob_values", "logprob_ranks", "num_prompt_logprob_positions", "num_prompt_logprob_entries", "prompt_logprob_token_ids", "prompt_logprob_values", "prompt_logprob_ranks", "stats", "queued_s", "error_codes", "pooled")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROB_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROB_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_VALUES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_LOGPROB_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_LOGPROB_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_VALUES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_RANKS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODES_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    parent_request_ids: _containers.RepeatedScalarFieldContainer[str]
    indices: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reasons: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    cumulative_logprobs: _containers.RepeatedScalarFieldContainer[float]
    errors: _containers.RepeatedScalarFieldContainer[str]
    num_logprob_positions: _containers.RepeatedScalarFieldContainer[int]
    num_logprob_entries: _containers.RepeatedScalarFieldContainer[int]
    logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprob_values: _containers.RepeatedScalarFieldContainer[float]
    logprob_ranks: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_logprob_positions: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_logprob_entries: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprob_values: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprob_ranks: _containers.RepeatedScalarFieldContainer[int]
    stats: SchedulerStats
    queued_s: _containers.RepeatedScalarFieldContainer[float]
    error_codes: _containers.RepeatedScalarFieldContainer[str]
    pooled: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., parent_request_ids: _Optional[_Iterable[str]] = ..., indices: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., finish_reasons: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ..., cumulative_logprobs: _Optional[_Iterable[float]] = ..., errors: _Optional[_Iterable[str]] = ..., num_logprob_positions: _Optional[_Iterable[int]] = ..., num_logprob_entries: _Optional[_Iterable[int]] = ..., logprob_token_ids: _Optional[_Iterable[int]] = ..., logprob_values: _Optional[_Iterable[float]] = ..., logprob_ranks: _Optional[_Iterable[int]] = ..., num_prompt_logprob_positions: _Optional[_Iterable[int]] = ..., num_prompt_logprob_entries: _Optional[_Iterable[int]] = ..., prompt_logprob_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprob_values: _Optional[_Iterable[float]] = ..., prompt_logprob_ranks: _Optional[_Iterable[int]] = ..., stats: _Optional[_Union[SchedulerStats, _Mapping]] = ..., queued_s: _Optional[_Iterable[float]] = ..., error_codes: _Optional[_Iterable[str]] = ..., pooled: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running_reqs", "num_waiting_reqs", "num_swapped_reqs", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "running_lora_adapters", "waiting_lora_adapters", "max_lora")
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
    def __init__(self, num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., num_swapped_reqs: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., running_lora_adapters: _Optional[_Iterable[str]] = ..., waiting_lora_adapters: _Optional[_Iterable[str]] = ..., max_lora: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("reset", "stored", "removed", "stats", "block_size", "prefix_caching")
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    stats: SchedulerStats
    block_size: int
    prefix_caching: bool
    def __init__(self, reset: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., stats: _Optional[_Union[SchedulerStats, _Mapping]] = ..., block_size: _Optional[int] = ..., prefix_caching: _Optional[bool] = ...) -> None: ...
