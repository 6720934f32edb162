"""DeepSeek-R1 and its distills (also Phi-4-mini-reasoning): `<think>` ... `</think>`,
where everything before `</think>` is thinking even when the reply does not open the
block (R1's later templates put `<think>` in the prompt; earlier replies sometimes omit
it)."""

from __future__ import annotations

from services.common.reasoning_bounds import ReasoningMode
from services.frontend.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    default_mode = ReasoningMode.THINKING
