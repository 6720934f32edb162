"""OpenAI request bodies (pydantic, OpenAI's field names plus vLLM's sampling extras).

Each request turns itself into SamplingParams; every bad value raises a ValueError that
names the field (InvalidRequestError, or SamplingParams' own checks), which the error
mapping turns into HTTP 400. Unknown fields are ignored, as OpenAI's servers do.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.common.sampling_defaults import sampling_params_with_defaults
from services.common.sampling_params import MAX_LOGPROBS, SamplingParams
from services.common.structured_outputs import StructuredOutputsParams
from services.frontend.openai.chat_messages import ChatMessage, ChatTool, ToolChoice
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.openai.structured_request import StructuredOutputFields
from services.frontend.pair_scoring import pair_texts

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(StructuredOutputFields, OpenAIBaseModel):
    """The fields completions and chat share: OpenAI's, then vLLM's extras (the
    structured-output ones are in structured_request.py)."""

    model: str | None = None
    n: int = Field(1, ge=1)  # the upper bound is the frontend's max_n (request_limits.py)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    priority: int = 0
    cache_salt: str | None = None

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options can only be set when stream is true.", "stream_options"
            )

    def _logit_bias(self, vocab_size: int) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids, got {key!r}.", "logit_bias"
                ) from None
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"logit_bias key {token_id} is outside the vocabulary [0, {vocab_size}).",
                    "logit_bias",
                )
            bias[token_id] = value
        return bias

    def to_sampling_params(
        self,
        max_tokens: int,
        vocab_size: int,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        defaults: dict | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """SamplingParams for one prompt (ValueError naming the field on a bad value).

        `defaults` (the model's generation_config, see generation_defaults.py) fill the
        sampling fields the request left unset. `structured_outputs` is the constraint
        (structured_outputs_params(), or the tool-call grammar); beam search refuses one."""
        if self.use_beam_search:
            return SamplingParams(
                n=self.n,
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=self.ignore_eos,
                use_beam_search=True,
                length_penalty=self.length_penalty,
                logprobs=logprobs,
                structured_outputs=structured_outputs,
            )
        requested = {
            key: value
            for key, value in (
                ("temperature", self.temperature),
                ("top_p", self.top_p),
                ("top_k", self.top_k),
                ("min_p", self.min_p),
                ("repetition_penalty", self.repetition_penalty),
            )
            if value is not None
        }
        return sampling_params_with_defaults(
            dict(
                requested,
                n=self.n,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                logit_bias=self._logit_bias(vocab_size),
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                structured_outputs=structured_outputs,
            ),
            defaults,
        )


PromptInput = list[int] | list[list[int]] | str | list[str]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_logprobs: int | None = None

    @property
    def scores_prompt_only(self) -> bool:
        """echo with max_tokens=0: return the prompt (and its logprobs), generate nothing."""
        return self.echo and self.max_tokens == 0

    def check(self) -> None:
        self.check_stream_options()
        if self.suffix is not None:
            raise InvalidRequestError("suffix is not supported by this server.", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                f"best_of must equal n when given (got best_of={self.best_of}, n={self.n}).",
                "best_of",
            )

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings or token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty.", "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    add_special_tokens: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # Reasoning models: variables for the chat template ({"enable_thinking": false}), over
    # the server's --default-chat-template-kwargs; the engine ends the thinking after
    # thinking_token_budget tokens (needs --reasoning-parser). reasoning_effort is OpenAI's
    # knob, accepted and passed to the template as `reasoning_effort` (templates that know
    # it use it; none of the native families' do).
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = Field(None, ge=0)
    reasoning_effort: str | None = None
    include_reasoning: bool = True  # vLLM's: false drops the thinking from the reply

    def check(self) -> None:
        self.check_stream_options()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true.", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}.",
                "top_logprobs",
            )

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages.", "prompt")


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's /v1/load_lora_adapter; load_inplace replaces an adapter of that name."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: int | None = None


# ---- embeddings ----------------------------------------------------------------------
EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class PooledInputsRequest(OpenAIBaseModel):
    """What a pooling route reads: one input or many (strings or token id lists)."""

    model: str | None = None
    input: EmbeddingInput
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    priority: int = 0

    def prompts(self) -> list[str | list[int]]:
        """The inputs, one prompt each: a string, or a list of token ids."""
        value = self.input
        if isinstance(value, str):
            items: list = [value]
        elif value and all(isinstance(v, int) for v in value):
            items = [value]  # one input as token ids
        else:
            items = list(value)
        if not items:
            raise InvalidRequestError("input must not be empty.", "input")
        for i, item in enumerate(items):
            if not item:
                raise InvalidRequestError(f"input[{i}] is empty.", "input")
        return items


class EmbeddingRequest(PooledInputsRequest):
    """OpenAI's /v1/embeddings body, plus vLLM's extras (normalize, add_special_tokens,
    priority) and `prompt_name` (one of the model's sentence-transformers prompts)."""

    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None
    prompt_name: str | None = None

    def check(self) -> None:
        if self.encoding_format not in ("float", "base64"):
            raise InvalidRequestError(
                f"encoding_format must be 'float' or 'base64', got {self.encoding_format!r}.",
                "encoding_format",
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(
                f"dimensions must be at least 1, got {self.dimensions}.", "dimensions"
            )


# ---- scores and reranking -------------------------------------------------------------
class ScoreRequest(OpenAIBaseModel):
    """vLLM's /v1/score: text_1 against text_2 (one against many, or pairwise)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int = 0

    def pairs(self) -> list[tuple[str, str]]:
        """(text_1, text_2) per score: one text_1 against every text_2, or pairwise."""
        return pair_texts(self.text_1, self.text_2)


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankRequest(OpenAIBaseModel):
    """Jina's / Cohere's /rerank (vLLM's /rerank, /v1/rerank, /v2/rerank): the documents
    ordered by relevance to the query, the top_n best (0 or none: all)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ClassificationRequest(PooledInputsRequest):
    """vLLM's /v1/classify: each input's label probabilities."""
