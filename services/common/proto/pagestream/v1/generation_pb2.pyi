from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReasoningMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASONING_MODE_ANSWER: _ClassVar[ReasoningMode]
    REASONING_MODE_THINKING: _ClassVar[ReasoningMode]
    REASONING_MODE_OPTIONAL: _ClassVar[ReasoningMode]
REASONING_MODE_ANSWER: ReasoningMode
REASONING_MODE_THINKING: ReasoningMode
REASONING_MODE_OPTIONAL: ReasoningMode

class SamplingParams(_message.Message):
    __slots__ = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "logit_bias", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "use_beam_search", "length_penalty", "structured_outputs", "thinking_token_budget", "reasoning")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    USE_BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    max_tokens: int
    min_tokens: int
    logprobs: int
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    include_stop_str_in_output: bool
    use_beam_search: bool
    length_penalty: float
    structured_outputs: StructuredOutputs
    thinking_token_budget: int
    reasoning: ReasoningBounds
    def __init__(self, n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., use_beam_search: _Optional[bool] = ..., length_penalty: _Optional[float] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., thinking_token_budget: _Optional[int] = ..., reasoning: _Optional[_Union[ReasoningBounds, _Mapping]] = ...) -> None: ...

class ReasoningBounds(_message.Message):
    __slots__ = ("mode", "start_token_ids", "end_token_ids", "forced_end_token_ids")
    MODE_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORCED_END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    mode: ReasoningMode
    start_token_ids: _containers.RepeatedScalarFieldContainer[int]
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    forced_end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, mode: _Optional[_Union[ReasoningMode, str]] = ..., start_token_ids: _Optional[_Iterable[int]] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., forced_end_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "regex", "choice", "grammar", "json_object", "whitespace_pattern", "disable_any_whitespace", "disable_additional_properties")
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_PATTERN_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ADDITIONAL_PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: Choices
    grammar: str
    json_object: bool
    whitespace_pattern: str
    disable_any_whitespace: bool
    disable_additional_properties: bool
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., whitespace_pattern: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ..., disable_additional_properties: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image", "image_url")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_URL_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: bytes
    image_url: str
    def __init__(self, text: _Optional[str] = ..., image: _Optional[bytes] = ..., image_url: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "chat_template", "chat_template_kwargs")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    chat_template: str
    chat_template_kwargs: _struct_pb2.Struct
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., chat_template: _Optional[str] = ..., chat_template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling_params", "priority", "cache_salt", "add_special_tokens", "lora_name", "model", "keep_alive")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling_params: SamplingParams
    priority: int
    cache_salt: str
    add_special_tokens: bool
    lora_name: str
    model: str
    keep_alive: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., lora_name: _Optional[str] = ..., model: _Optional[str] = ..., keep_alive: _Optional[str] = ...) -> None: ...

class PoolingParams(_message.Message):
    __slots__ = ("task", "dimensions", "normalize", "truncate_prompt_tokens", "prompt_name")
    TASK_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    task: str
    dimensions: int
    normalize: bool
    truncate_prompt_tokens: int
    prompt_name: str
    def __init__(self, task: _Optional[str] = ..., dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., prompt_name: _Optional[str] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "inputs", "pooling_params", "priority", "add_special_tokens", "model", "keep_alive")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    POOLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    pooling_params: PoolingParams
    priority: int
    add_special_tokens: bool
    model: str
    keep_alive: str
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., pooling_params: _Optional[_Union[PoolingParams, _Mapping]] = ..., priority: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ..., model: _Optional[str] = ..., keep_alive: _Optional[str] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "prompt_tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("request_id", "embeddings", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "text_1", "text_2", "truncate_prompt_tokens", "priority", "model", "keep_alive")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_1_FIELD_NUMBER: _ClassVar[int]
    TEXT_2_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text_1: _containers.RepeatedScalarFieldContainer[str]
    text_2: _containers.RepeatedScalarFieldContainer[str]
    truncate_prompt_tokens: int
    priority: int
    model: str
    keep_alive: str
    def __init__(self, request_id: _Optional[str] = ..., text_1: _Optional[_Iterable[str]] = ..., text_2: _Optional[_Iterable[str]] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., model: _Optional[str] = ..., keep_alive: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "scores", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    scores: _containers.RepeatedScalarFieldContainer[float]
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., scores: _Optional[_Iterable[float]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("request_id", "query", "documents", "top_n", "return_documents", "truncate_prompt_tokens", "priority", "model", "keep_alive")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    query: str
    documents: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    return_documents: bool
    truncate_prompt_tokens: int
    priority: int
    model: str
    keep_alive: str
    def __init__(self, request_id: _Optional[str] = ..., query: _Optional[str] = ..., documents: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ..., return_documents: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., model: _Optional[str] = ..., keep_alive: _Optional[str] = ...) -> None: ...

class RerankResult(_message.Message):
    __slots__ = ("index", "relevance_score", "document")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RELEVANCE_SCORE_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    relevance_score: float
    document: str
    def __init__(self, index: _Optional[int] = ..., relevance_score: _Optional[float] = ..., document: _Optional[str] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("request_id", "results", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    results: _containers.RepeatedCompositeFieldContainer[RerankResult]
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[RerankResult, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("request_id", "inputs", "truncate_prompt_tokens", "priority", "add_special_tokens", "model", "keep_alive")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    truncate_prompt_tokens: int
    priority: int
    add_special_tokens: bool
    model: str
    keep_alive: str
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ..., model: _Optional[str] = ..., keep_alive: _Optional[str] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("probs", "label", "prompt_tokens")
    PROBS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    label: str
    prompt_tokens: int
    def __init__(self, probs: _Optional[_Iterable[float]] = ..., label: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("request_id", "classifications", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLASSIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    classifications: _containers.RepeatedCompositeFieldContainer[Classification]
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., classifications: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "id", "digest", "base_model_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: int
    digest: str
    base_model_name: str
    def __init__(self, name: _Optional[str] = ..., id: _Optional[int] = ..., digest: _Optional[str] = ..., base_model_name: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., token: _Optional[str] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "text", "token_ids", "logprobs", "prompt_logprobs", "finish_reason", "stop_token_id", "stop_string", "cumulative_logprob", "usage", "num_cached_tokens", "reasoning_text")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    finish_reason: str
    stop_token_id: int
    stop_string: str
    cumulative_logprob: float
    usage: Usage
    num_cached_tokens: int
    reasoning_text: str
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., cumulative_logprob: _Optional[float] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., reasoning_text: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens", "model", "keep_alive")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    add_special_tokens: bool
    model: str
    keep_alive: str
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., model: _Optional[str] = ..., keep_alive: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "count", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    count: int
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens", "model", "keep_alive")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    model: str
    keep_alive: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., model: _Optional[str] = ..., keep_alive: _Optional[str] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model", "keep_alive")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    model: str
    keep_alive: str
    def __init__(self, model: _Optional[str] = ..., keep_alive: _Optional[str] = ...) -> None: ...

class ModelCapabilities(_message.Message):
    __slots__ = ("can_generate", "pooler", "lora", "speculative")
    CAN_GENERATE_FIELD_NUMBER: _ClassVar[int]
    POOLER_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    can_generate: bool
    pooler: PoolerCapability
    lora: LoRACapability
    speculative: SpeculativeCapability
    def __init__(self, can_generate: _Optional[bool] = ..., pooler: _Optional[_Union[PoolerCapability, _Mapping]] = ..., lora: _Optional[_Union[LoRACapability, _Mapping]] = ..., speculative: _Optional[_Union[SpeculativeCapability, _Mapping]] = ...) -> None: ...

class PoolerCapability(_message.Message):
    __slots__ = ("pooling_type", "normalize", "dimensions", "hidden_size", "matryoshka_dimensions", "whole_prompt", "num_labels", "score_activation", "labels", "prompts", "default_prompt_name", "chat_template_inputs")
    class PromptsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MATRYOSHKA_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    WHOLE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_LABELS_FIELD_NUMBER: _ClassVar[int]
    SCORE_ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROMPT_NAME_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_INPUTS_FIELD_NUMBER: _ClassVar[int]
    pooling_type: str
    normalize: bool
    dimensions: int
    hidden_size: int
    matryoshka_dimensions: _containers.RepeatedScalarFieldContainer[int]
    whole_prompt: bool
    num_labels: int
    score_activation: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    prompts: _containers.ScalarMap[str, str]
    default_prompt_name: str
    chat_template_inputs: bool
    def __init__(self, pooling_type: _Optional[str] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., hidden_size: _Optional[int] = ..., matryoshka_dimensions: _Optional[_Iterable[int]] = ..., whole_prompt: _Optional[bool] = ..., num_labels: _Optional[int] = ..., score_activation: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., prompts: _Optional[_Mapping[str, str]] = ..., default_prompt_name: _Optional[str] = ..., chat_template_inputs: _Optional[bool] = ...) -> None: ...

class LoRACapability(_message.Message):
    __slots__ = ("max_loras", "max_lora_rank", "max_cpu_loras", "modules", "num_layers")
    class ModulesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: LinearShape
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[LinearShape, _Mapping]] = ...) -> None: ...
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    modules: _containers.MessageMap[str, LinearShape]
    num_layers: int
    def __init__(self, max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., modules: _Optional[_Mapping[str, LinearShape]] = ..., num_layers: _Optional[int] = ...) -> None: ...

class LinearShape(_message.Message):
    __slots__ = ("in_features", "out_features")
    IN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    OUT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    in_features: int
    out_features: int
    def __init__(self, in_features: _Optional[int] = ..., out_features: _Optional[int] = ...) -> None: ...

class SpeculativeCapability(_message.Message):
    __slots__ = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "disable_by_batch_size")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MAX_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DISABLE_BY_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    model: str
    disable_by_batch_size: int
    def __init__(self, method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., prompt_lookup_min: _Optional[int] = ..., prompt_lookup_max: _Optional[int] = ..., model: _Optional[str] = ..., disable_by_batch_size: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "architecture", "dtype", "max_model_len", "vocab_size", "eos_token_ids", "block_size", "num_gpu_blocks", "quantization", "weight_bytes", "speculative_decoding", "lora_adapters", "runner", "capabilities")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_DECODING_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    dtype: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    num_gpu_blocks: int
    quantization: str
    weight_bytes: int
    speculative_decoding: str
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    runner: str
    capabilities: ModelCapabilities
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., quantization: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., speculative_decoding: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ..., runner: _Optional[str] = ..., capabilities: _Optional[_Union[ModelCapabilities, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("name", "state", "error", "pinned", "max_model_len")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    error: str
    pinned: bool
    max_model_len: int
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., error: _Optional[str] = ..., pinned: _Optional[bool] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "default_model")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODEL_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    default_model: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ..., default_model: _Optional[str] = ...) -> None: ...
