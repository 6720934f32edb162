"""Logprobs in OpenAI's two formats: completions (tokens / token_logprobs / top_logprobs /
text_offset) and chat (content entries with bytes and top_logprobs)."""

from __future__ import annotations

import math

from services.common.outputs import Logprob
from services.frontend.openai.replies import (
    ChatLogprobEntry,
    ChatTopLogprob,
    CompletionLogProbs,
)

_FLOOR = -9999.0  # what OpenAI-compatible servers send instead of -inf (JSON has no -inf)


def clamp(logprob: float) -> float:
    return _FLOOR if math.isnan(logprob) or logprob < _FLOOR else logprob


def _token_text(token_id: int, entry: Logprob, tokenizer) -> str:
    if entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


class CompletionLogprobsBuilder:
    """Builds completions-format logprobs across streamed deltas (text_offset runs on)."""

    def __init__(self, tokenizer, start_offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.offset = start_offset

    def build(
        self, token_ids: list[int], positions: list[dict[int, Logprob] | None]
    ) -> CompletionLogProbs:
        out = CompletionLogProbs()
        for token_id, position in zip(token_ids, positions, strict=False):
            out.text_offset.append(self.offset)
            if position is None or token_id not in position:  # the first prompt token
                text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
                out.tokens.append(text)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                text = _token_text(token_id, position[token_id], self.tokenizer)
                out.tokens.append(text)
                out.token_logprobs.append(clamp(position[token_id].logprob))
                out.top_logprobs.append(
                    {
                        _token_text(tid, lp, self.tokenizer): clamp(lp.logprob)
                        for tid, lp in position.items()
                    }
                )
            self.offset += len(text)
        return out


def chat_logprobs(
    token_ids: list[int],
    positions: list[dict[int, Logprob]],
    num_top: int,
    tokenizer,
) -> list[ChatLogprobEntry]:
    """Chat-format entries: the chosen token, then the num_top most likely, best first."""
    entries = []
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id)
        if chosen is None:
            continue
        ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
        top = [
            _top(tid, lp, tokenizer) for tid, lp in ranked if lp.rank is None or lp.rank <= num_top
        ][:num_top]
        text = _token_text(token_id, chosen, tokenizer)
        entries.append(
            ChatLogprobEntry(
                token=text,
                logprob=clamp(chosen.logprob),
                bytes=list(text.encode("utf-8")),
                top_logprobs=top,
            )
        )
    return entries


def _top(token_id: int, entry: Logprob, tokenizer) -> ChatTopLogprob:
    text = _token_text(token_id, entry, tokenizer)
    return ChatTopLogprob(token=text, logprob=clamp(entry.logprob), bytes=list(text.encode()))
