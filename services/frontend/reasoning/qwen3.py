"""Qwen3 (and SmolLM3, QwQ): `<think>` ... `</think>`. Hybrid checkpoints open the block
themselves when thinking is on; with enable_thinking=false the template writes an empty,
closed block into the prompt; thinking-only checkpoints (Qwen3-*-Thinking-2507) have
templates that open `<think>` in the prompt, so the reply starts inside it."""

from __future__ import annotations

from services.common.reasoning_bounds import ReasoningMode
from services.frontend.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    default_mode = ReasoningMode.OPTIONAL
