"""What a request's sampling params need from the server's reasoning parser, for every
API: markers that survive detokenizing, and the thinking's bounds in token ids when the
engine must know where the thinking ends (a grammar applies to the answer only; a
thinking budget ends the thinking)."""

from __future__ import annotations

from services.common.reasoning_bounds import ReasoningMode
from services.common.sampling_params import SamplingParams
from services.frontend.reasoning.base import ReasoningParser


def bound_reasoning(
    params: SamplingParams, parser: ReasoningParser | None, tokenizer, prompt_text: str
) -> None:
    """Set `params.reasoning` (and keep special-token markers) from the parser and the
    prompt's end; a client's own bounds are replaced. ValueError (naming
    thinking_token_budget) for a budget on a server without a parser."""
    params.reasoning = None
    if parser is None:
        if params.thinking_token_budget is not None:
            raise ValueError(
                "thinking_token_budget needs a reasoning model served with "
                "--reasoning-parser; this server has none."
            )
        return
    if parser.marks_are_special(tokenizer):
        params.skip_special_tokens = False
    if params.thinking_token_budget is not None or params.structured_outputs is not None:
        params.reasoning = bounds = parser.bounds(tokenizer, prompt_text)
        if (
            params.thinking_token_budget is not None
            and bounds.mode == ReasoningMode.OPTIONAL
            and len(bounds.start_token_ids) != 1
        ):  # the engine sees the model open the thinking only as one token
            raise ValueError(
                f"thinking_token_budget needs the model's {parser.start!r} to be one token "
                "of its vocabulary; this tokenizer splits it."
            )
