"""SpeculativeConfig: vLLM's `speculative_config` (a dict, or JSON on the command line).

Two methods: "ngram" proposes the tokens that followed the latest earlier occurrence of
the sequence's last n tokens (prompt lookup, n from prompt_lookup_max down to
prompt_lookup_min); "draft_model" runs a smaller model of the same vocabulary on the same
worker, with its own KV cache in the same block tables. Either way the target verifies
num_speculative_tokens proposals per decoding sequence in one step, and the outputs are
those of the target alone (services/worker/spec_decode/).

Torch-free: the command line, the scheduler and the worker all read it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields

SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's defaults when neither bound of the n-gram is given.
DEFAULT_PROMPT_LOOKUP = 5
# No proposals while the step runs at least this many sequences: past it a verification
# step costs about what its accepted tokens gain (`pagestream bench speculative`).
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    model: str | None = None  # draft_model: the draft's folder, .gguf file or package name
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                f"got {self.method!r}."
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"speculative_config.{name} must be an integer >= 1, got {value!r}."
                )
        if not isinstance(self.prompt_lookup_max, int) or (
            self.prompt_lookup_max < self.prompt_lookup_min
        ):
            raise ValueError(
                f"speculative_config.prompt_lookup_max ({self.prompt_lookup_max!r}) must be an "
                f"integer >= prompt_lookup_min ({self.prompt_lookup_min})."
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: the draft_model method needs a model.")
        if self.method == "ngram" and self.model:
            raise ValueError(
                f"speculative_config.model ({self.model!r}) is only for the draft_model method."
            )

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a sequence needs past its scheduled tokens: the draft model writes its
        own proposals' keys and values while it makes them."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def parse(cls, value: Mapping | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From vLLM's dict (or its JSON text); None, {} and "" mean no speculation.

        `method` may be left out when `model` names the draft (or is "ngram" / "[ngram]",
        vLLM's older spelling); unknown keys are refused by name.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = _from_json(value)
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}.")
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; known: {sorted(known)}."
            )
        return cls(**_with_defaults(dict(value)))

    def to_json(self) -> str:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return json.dumps({k: v for k, v in values.items() if v is not None}, sort_keys=True)

    def describe(self) -> str:
        """A short name for logs, metrics and GetModelInfo: "ngram k=4", "draft_model k=3"."""
        return f"{self.method} k={self.num_speculative_tokens}"


def _from_json(text: str) -> dict:
    if not text.strip():
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc


def _with_defaults(values: dict) -> dict:
    """vLLM's inferences and defaults: the method from the model, the n-gram's bounds
    from each other (both 5 when neither is given)."""
    if values.get("model") in ("ngram", "[ngram]"):
        values.pop("model")
        values.setdefault("method", "ngram")
    if "method" not in values:
        if not values.get("model"):
            raise ValueError("speculative_config needs a method (ngram or draft_model).")
        values["method"] = "draft_model"
    if "num_speculative_tokens" not in values:
        raise ValueError("speculative_config.num_speculative_tokens is required.")
    low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    values["prompt_lookup_min"] = high if low is None else low
    values["prompt_lookup_max"] = low if high is None else high
    if values.get("disable_by_batch_size") is None:
        values["disable_by_batch_size"] = DEFAULT_DISABLE_BY_BATCH_SIZE
    return values
