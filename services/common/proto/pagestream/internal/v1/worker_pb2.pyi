from services.common.proto.pagestream.internal.v1 import image_pb2 as _image_pb2
from services.common.proto.pagestream.internal.v1 import logprobs_pb2 as _logprobs_pb2
from services.common.proto.pagestream.internal.v1 import lora_pb2 as _lora_pb2
from services.common.proto.pagestream.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerDescription(_message.Message):
    __slots__ = ("model", "architecture", "dtype", "device", "num_layers", "num_kv_heads", "head_dim", "vocab_size", "eos_token_ids", "max_model_len", "rank", "world_size", "tensor_parallel_size", "pipeline_parallel_size", "quantization", "weight_bytes", "capabilities", "kv_cache_groups")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    dtype: str
    device: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    rank: int
    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    quantization: str
    weight_bytes: int
    capabilities: _generation_pb2.ModelCapabilities
    kv_cache_groups: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., quantization: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., capabilities: _Optional[_Union[_generation_pb2.ModelCapabilities, _Mapping]] = ..., kv_cache_groups: _Optional[_Iterable[int]] = ...) -> None: ...

class InitializeCacheRequest(_message.Message):
    __slots__ = ("max_model_len", "max_num_seqs", "max_num_batched_tokens")
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    def __init__(self, max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ...) -> None: ...

class AllocateCacheRequest(_message.Message):
    __slots__ = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_device_blocks", "num_cpu_blocks")
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_device_blocks: int
    num_cpu_blocks: int
    def __init__(self, max_model_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., num_device_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ...) -> None: ...

class CacheDescription(_message.Message):
    __slots__ = ("num_device_blocks", "num_cpu_blocks", "block_size", "bytes_per_block")
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    num_device_blocks: int
    num_cpu_blocks: int
    block_size: int
    bytes_per_block: int
    def __init__(self, num_device_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., bytes_per_block: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling_params", "pooling_params", "block_ids", "num_computed_tokens", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    POOLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generation_pb2.SamplingParams
    pooling_params: _generation_pb2.PoolingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    images: _containers.RepeatedCompositeFieldContainer[_image_pb2.ImageInput]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., pooling_params: _Optional[_Union[_generation_pb2.PoolingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., images: _Optional[_Iterable[_Union[_image_pb2.ImageInput, _Mapping]]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_request_ids", "cached_num_new_blocks", "cached_new_block_ids", "cached_num_computed_tokens", "cached_resumed", "scheduled_request_ids", "num_scheduled_tokens", "finished_request_ids", "blocks_to_copy", "blocks_to_swap_in", "blocks_to_swap_out", "cached_num_new_tokens", "cached_new_token_ids", "grammar_request_ids", "grammar_bitmask", "spec_request_ids", "num_spec_tokens", "spec_token_ids", "lora_request_ids", "lora_request_slots", "lora_slots", "lora_adapters", "num_kv_groups", "kv_drop_keys", "kv_drop_tiers", "kv_load_keys", "kv_load_blocks", "kv_save_blocks", "kv_save_keys")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_RESUMED_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    CACHED_NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_BITMASK_FIELD_NUMBER: _ClassVar[int]
    SPEC_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUEST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    KV_DROP_KEYS_FIELD_NUMBER: _ClassVar[int]
    KV_DROP_TIERS_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_KEYS_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_SAVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_SAVE_KEYS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_request_ids: _containers.RepeatedScalarFieldContainer[str]
    cached_num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    cached_new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    cached_resumed: _containers.RepeatedScalarFieldContainer[bool]
    scheduled_request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    blocks_to_copy: _containers.RepeatedScalarFieldContainer[int]
    blocks_to_swap_in: _containers.RepeatedScalarFieldContainer[int]
    blocks_to_swap_out: _containers.RepeatedScalarFieldContainer[int]
    cached_num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    cached_new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    grammar_request_ids: _containers.RepeatedScalarFieldContainer[str]
    grammar_bitmask: bytes
    spec_request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_spec_tokens: _containers.RepeatedScalarFieldContainer[int]
    spec_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_request_ids: _containers.RepeatedScalarFieldContainer[str]
    lora_request_slots: _containers.RepeatedScalarFieldContainer[int]
    lora_slots: _containers.RepeatedScalarFieldContainer[int]
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_lora_pb2.LoRAAdapter]
    num_kv_groups: int
    kv_drop_keys: _containers.RepeatedScalarFieldContainer[bytes]
    kv_drop_tiers: _containers.RepeatedScalarFieldContainer[str]
    kv_load_keys: _containers.RepeatedScalarFieldContainer[bytes]
    kv_load_blocks: _containers.RepeatedScalarFieldContainer[int]
    kv_save_blocks: _containers.RepeatedScalarFieldContainer[int]
    kv_save_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_request_ids: _Optional[_Iterable[str]] = ..., cached_num_new_blocks: _Optional[_Iterable[int]] = ..., cached_new_block_ids: _Optional[_Iterable[int]] = ..., cached_num_computed_tokens: _Optional[_Iterable[int]] = ..., cached_resumed: _Optional[_Iterable[bool]] = ..., scheduled_request_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., blocks_to_copy: _Optional[_Iterable[int]] = ..., blocks_to_swap_in: _Optional[_Iterable[int]] = ..., blocks_to_swap_out: _Optional[_Iterable[int]] = ..., cached_num_new_tokens: _Optional[_Iterable[int]] = ..., cached_new_token_ids: _Optional[_Iterable[int]] = ..., grammar_request_ids: _Optional[_Iterable[str]] = ..., grammar_bitmask: _Optional[bytes] = ..., spec_request_ids: _Optional[_Iterable[str]] = ..., num_spec_tokens: _Optional[_Iterable[int]] = ..., spec_token_ids: _Optional[_Iterable[int]] = ..., lora_request_ids: _Optional[_Iterable[str]] = ..., lora_request_slots: _Optional[_Iterable[int]] = ..., lora_slots: _Optional[_Iterable[int]] = ..., lora_adapters: _Optional[_Iterable[_Union[_lora_pb2.LoRAAdapter, _Mapping]]] = ..., num_kv_groups: _Optional[int] = ..., kv_drop_keys: _Optional[_Iterable[bytes]] = ..., kv_drop_tiers: _Optional[_Iterable[str]] = ..., kv_load_keys: _Optional[_Iterable[bytes]] = ..., kv_load_blocks: _Optional[_Iterable[int]] = ..., kv_save_blocks: _Optional[_Iterable[int]] = ..., kv_save_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "request_ids", "num_sampled", "sampled_token_ids", "logprobs", "prompt_logprobs", "prepare_s", "forward_s", "sample_s", "error", "spec_request_ids", "num_spec_tokens", "spec_token_ids", "request_errors", "pooled", "kv_load_failures")
    class LogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _logprobs_pb2.Logprobs
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_logprobs_pb2.Logprobs, _Mapping]] = ...) -> None: ...
    class PromptLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _logprobs_pb2.Logprobs
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_logprobs_pb2.Logprobs, _Mapping]] = ...) -> None: ...
    class RequestErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class PooledEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SPEC_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ERRORS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_sampled: _containers.RepeatedScalarFieldContainer[int]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.MessageMap[str, _logprobs_pb2.Logprobs]
    prompt_logprobs: _containers.MessageMap[str, _logprobs_pb2.Logprobs]
    prepare_s: float
    forward_s: float
    sample_s: float
    error: str
    spec_request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_spec_tokens: _containers.RepeatedScalarFieldContainer[int]
    spec_token_ids: _containers.RepeatedScalarFieldContainer[int]
    request_errors: _containers.ScalarMap[str, str]
    pooled: _containers.ScalarMap[str, bytes]
    kv_load_failures: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, step_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., num_sampled: _Optional[_Iterable[int]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Mapping[str, _logprobs_pb2.Logprobs]] = ..., prompt_logprobs: _Optional[_Mapping[str, _logprobs_pb2.Logprobs]] = ..., prepare_s: _Optional[float] = ..., forward_s: _Optional[float] = ..., sample_s: _Optional[float] = ..., error: _Optional[str] = ..., spec_request_ids: _Optional[_Iterable[str]] = ..., num_spec_tokens: _Optional[_Iterable[int]] = ..., spec_token_ids: _Optional[_Iterable[int]] = ..., request_errors: _Optional[_Mapping[str, str]] = ..., pooled: _Optional[_Mapping[str, bytes]] = ..., kv_load_failures: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
