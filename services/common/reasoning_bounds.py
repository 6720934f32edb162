"""ReasoningBounds: where a reasoning model's thinking starts and ends, in token ids.

The frontend's reasoning parser knows the format (`<think>` ... `</think>`); the engine
only needs the ids, to apply a grammar to the answer alone and to end the thinking when
its budget is spent (services/scheduler; the proto's ReasoningBounds). Invalid values
raise ValueError naming the field, like SamplingParams' own checks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# A marker is a handful of tokens in every format; the bound keeps the per-token end
# check and the forced sequence small whatever a client sends.
MAX_MARKER_TOKENS = 64
_ID_FIELDS = ("start_token_ids", "end_token_ids", "forced_end_token_ids")


class ReasoningMode(enum.IntEnum):
    """How a sequence's output begins (values are the proto's ReasoningMode)."""

    ANSWER = 0  # no thinking: the output is the answer from its first token
    THINKING = 1  # the prompt opened the thinking; end_token_ids close it
    OPTIONAL = 2  # thinking only if the output starts with start_token_ids


@dataclass(frozen=True)
class ReasoningBounds:
    mode: ReasoningMode = ReasoningMode.ANSWER
    start_token_ids: tuple[int, ...] = field(default_factory=tuple)
    end_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # What the engine writes when the thinking budget is spent.
    forced_end_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _mode(self.mode))
        for name in _ID_FIELDS:
            object.__setattr__(self, name, _token_ids(name, getattr(self, name)))
        if self.mode != ReasoningMode.ANSWER and not self.end_token_ids:
            raise ValueError(
                f"reasoning.end_token_ids must not be empty in mode {self.mode.name}: "
                "nothing would end the thinking."
            )
        if self.mode == ReasoningMode.OPTIONAL and not self.start_token_ids:
            raise ValueError("reasoning.start_token_ids must not be empty in mode OPTIONAL.")

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the first id outside the model's vocabulary."""
        for name in _ID_FIELDS:
            bad = [t for t in getattr(self, name) if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"reasoning.{name} contains token id {bad[0]}, outside the vocabulary "
                    f"[0, {vocab_size})."
                )


def _mode(value) -> ReasoningMode:
    try:
        return ReasoningMode(value)
    except ValueError:
        names = ", ".join(f"{m.name} ({m.value})" for m in ReasoningMode)
        raise ValueError(f"reasoning.mode must be one of {names}, got {value!r}.") from None


def _token_ids(name: str, ids) -> tuple[int, ...]:
    if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
        raise ValueError(f"reasoning.{name} must be a list of token ids, got {ids!r}.")
    ids = tuple(ids)
    if len(ids) > MAX_MARKER_TOKENS:
        raise ValueError(
            f"reasoning.{name} has {len(ids)} token ids; at most {MAX_MARKER_TOKENS} are allowed."
        )
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ValueError(f"reasoning.{name} must hold token ids >= 0, got {list(ids)}.")
    return ids
