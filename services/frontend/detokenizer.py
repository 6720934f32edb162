"""IncrementalDetokenizer: token ids -> text deltas, with stop strings.

Text comes from `tokenizers.decoders.DecodeStream`, which buffers tokens until they form
valid UTF-8 (multi-byte characters, byte-fallback tokens). Stop strings are searched in
the text as it comes (stop_matcher.py: each piece read once); a stop string trims the
output (unless include_stop_str_in_output) and ends the request with stop_reason = the
string. While streaming, a suffix that could still grow into a stop string is held back
until it either does or cannot any more.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from services.common.sampling_params import SamplingParams
from services.frontend.stop_matcher import StopMatcher

# How many prompt tokens seed the stream, so the first output token decodes in context
# (a leading space, a continuation of a word) exactly as the full decode would.
_PROMPT_CONTEXT_TOKENS = 8


@dataclass(frozen=True)
class DetokenizerUpdate:
    text_delta: str  # new text the client may see now
    stop_string: str | None = None  # set when a stop string ended the request
    # How many of the new tokens the output keeps: those up to the one that completed the
    # stop string (a step may bring several: speculative decoding); None: all of them.
    num_tokens_kept: int | None = None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)  # the Rust tokenizer
        self._stops = StopMatcher(params.stop) if params.stop else None
        self._include_stop = params.include_stop_str_in_output
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]),
            skip_special_tokens=params.skip_special_tokens,
        )
        # The text decoded so far is _released + _unreleased. Released text can never be
        # part of a stop string (so a stop string cuts only _unreleased); _unreleased is at
        # most the longest stop string plus one step's text, whatever the output's length.
        self._released: list[str] = []
        self._num_released = 0  # characters in _released
        self._unreleased = ""
        self.stop_string: str | None = None

    @property
    def output_text(self) -> str:
        """Everything decoded so far (trimmed once a stop string hits)."""
        return "".join(self._released) + self._unreleased

    def update(self, new_token_ids: list[int], finished: bool) -> DetokenizerUpdate:
        """Feed new tokens; returns the text that can be released now."""
        kept = None
        if self.stop_string is None:
            for count, token_id in enumerate(new_token_ids, 1):
                chunk = self._stream.step(self._tokenizer, token_id)
                if chunk and self._add(chunk):
                    kept = count
                    break
        done = finished or self.stop_string is not None
        held = 0 if done or self._stops is None else self._stops.held
        return DetokenizerUpdate(
            self._release(len(self._unreleased) - held), self.stop_string, kept
        )

    def _add(self, chunk: str) -> bool:
        """Append decoded text; True when it completed a stop string, where the text now ends."""
        self._unreleased += chunk
        match = self._stops.feed(chunk) if self._stops is not None else None
        if match is None:
            return False
        end = match.end if self._include_stop else match.start
        # end >= _num_released: text is released only once no stop string can start in it.
        self._unreleased = self._unreleased[: end - self._num_released]
        self.stop_string = match.stop
        return True

    def _release(self, size: int) -> str:
        """Hand out the first `size` unreleased characters."""
        delta, self._unreleased = self._unreleased[:size], self._unreleased[size:]
        if delta:
            self._released.append(delta)
            self._num_released += len(delta)
        return delta


class NullDetokenizer:
    """For engines started without a tokenizer: token ids only, no text."""

    output_text = ""
    stop_string = None

    def update(self, new_token_ids: list[int], finished: bool) -> DetokenizerUpdate:
        return DetokenizerUpdate("")


def make_detokenizer(tokenizer, prompt_token_ids: list[int], params: SamplingParams):
    if tokenizer is None:
        return NullDetokenizer()
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
