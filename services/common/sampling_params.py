"""SamplingParams: vLLM's field names, defaults and validation.

Every invalid value raises ValueError naming the field and the allowed range, so the
frontends can map it straight to HTTP 400 / gRPC INVALID_ARGUMENT.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from services.common.reasoning_bounds import ReasoningBounds
from services.common.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    below = value <= lo if lo_open else value < lo
    if math.isnan(value) or below or value > hi:
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {left}{lo}, {hi}], got {value}.")


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")


def _reasoning_bounds(value) -> ReasoningBounds | None:
    if value is None or isinstance(value, ReasoningBounds):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"reasoning must be ReasoningBounds or a dict, got {type(value)}.")
    try:
        return ReasoningBounds(**value)
    except TypeError as exc:
        raise ValueError(f"reasoning: {exc}.") from exc


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrain the output (JSON schema, regex, choice, grammar); a dict is taken as its fields.
    structured_outputs: StructuredOutputsParams | None = None
    # Reasoning models: end the thinking after this many thinking tokens by writing
    # reasoning.forced_end_token_ids (None: no budget; 0: end it at once).
    thinking_token_budget: int | None = None
    # Where the thinking starts and ends in token ids (the frontend sets it from its
    # reasoning parser): a grammar applies to the answer only. A dict is taken as its fields.
    reasoning: ReasoningBounds | None = None
    # Derived in __post_init__: stop is always a list afterwards.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.reasoning = _reasoning_bounds(self.reasoning)
        self._verify_args()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify_args(self) -> None:
        self._verify_counts()
        self._verify_probabilities()
        self._verify_stops()
        self.verify_thinking_budget()
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        for token_id, bias in self.logit_bias.items():
            if token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token_id}.")
            _check_range("logit_bias values", bias, -100.0, 100.0)
        _check_finite("length_penalty", self.length_penalty)
        if self.structured_outputs is not None and self.use_beam_search:
            raise ValueError(
                "structured_outputs cannot be combined with beam search: each beam would need "
                "its own grammar state; use n > 1 sampling instead."
            )
        if self.sampling_type == SamplingType.GREEDY and self.n > 1 and not self.use_beam_search:
            raise ValueError(
                f"n must be 1 when using greedy sampling (temperature 0), got n={self.n}; "
                "use beam search for several greedy candidates."
            )

    def _verify_counts(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")

    def _verify_probabilities(self) -> None:
        _check_range("temperature", self.temperature, 0.0, 2.0)
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(
                "repetition_penalty must be a finite number > 0 (1 disables it), "
                f"got {self.repetition_penalty}."
            )

    def _verify_stops(self) -> None:
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of token ids >= 0.")

    def verify_thinking_budget(self) -> None:
        """The budget's checks (the engine repeats them at admission: a frontend sets
        the budget and the bounds after construction)."""
        budget = self.thinking_token_budget
        if budget is None:
            return
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise ValueError(f"thinking_token_budget must be an integer, got {budget!r}.")
        _check_range("thinking_token_budget", budget, 0, INT32_MAX)
        bounds = self.reasoning
        if bounds is None or not bounds.end_token_ids or not bounds.forced_end_token_ids:
            raise ValueError(
                "thinking_token_budget needs the thinking's end marker, which the server "
                "knows only when it runs with --reasoning-parser."
            )
        if self.use_beam_search:
            raise ValueError(
                "thinking_token_budget cannot be combined with beam search: each beam "
                "would need its own thinking state; use n > 1 sampling instead."
            )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    def clone(self, **changes) -> SamplingParams:
        return replace(self, **changes)


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}.")
        _check_finite("length_penalty", self.length_penalty)
        if self.temperature != 0.0:
            raise ValueError("beam search here is deterministic: temperature must be 0.")

    def to_sampling_params(self) -> SamplingParams:
        """The engine-side form: beam_width sequences searched on shared blocks."""
        return SamplingParams(
            n=self.beam_width,
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            use_beam_search=True,
            length_penalty=self.length_penalty,
        )
