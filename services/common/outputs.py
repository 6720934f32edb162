"""RequestOutput and CompletionOutput: what users of LLM / AsyncEngine receive (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token and the top alternatives).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # stop, length, abort, error
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


# ---- pooling (vLLM's names) ----------------------------------------------------------
@dataclass
class PoolingOutput:
    """The raw pooled hidden state [hidden] float32 (`LLM.encode`, `AsyncEngine.encode`
    hand it out as a torch tensor, as vLLM does; numpy below the public API)."""

    data: np.ndarray


@dataclass
class EmbeddingOutput:
    """The embedding: the pooled state truncated (dimensions) and normalized as asked."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    """How relevant the second text is to the first (vLLM's `outputs.score`)."""

    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # both texts'
    finished: bool = True


@dataclass
class ClassificationOutput:
    """Each label's probability (vLLM's `outputs.probs`): a softmax over the labels, a
    sigmoid for a one-label model."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput | None  # None: it ended without a result (`error` says why)
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(
            request_id=output.request_id,
            outputs=EmbeddingOutput(output.outputs.data.tolist()),
            prompt_token_ids=output.prompt_token_ids,
            finished=output.finished,
            prompt=output.prompt,
            num_cached_tokens=output.num_cached_tokens,
        )
