"""Mistral's reasoning models (Magistral): `[THINK]` ... `[/THINK]`, special tokens of the
v13 tokenizers; the model opens the block itself when its system prompt asks it to
think."""

from __future__ import annotations

from services.common.reasoning_bounds import ReasoningMode
from services.frontend.reasoning.base import ReasoningParser


class MistralReasoningParser(ReasoningParser):
    name = "mistral"
    start = "[THINK]"
    end = "[/THINK]"
    forced_end = "[/THINK]"
    default_mode = ReasoningMode.OPTIONAL
