"""ReasoningBounds: where a reasoning model's thinking starts and ends, in token ids.

The frontend's reasoning parser knows the format (`<think>` ... `</think>`); the engine
only needs the ids, to apply a grammar to the answer alone and to end the thinking when
its budget is spent (services/scheduler; the proto's ReasoningBounds).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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
