"""IncrementalDetokenizer: token ids -> text deltas, with stop strings.

Text comes from `tokenizers.decoders.DecodeStream`, which buffers tokens until they form
valid UTF-8 (multi-byte characters, byte-fallback tokens). Stop strings are searched in
the text; a stop string trims the output (unless include_stop_str_in_output) and ends the
request with stop_reason = the string. While streaming, a suffix that could still grow
into a stop string is held back until it either does or cannot any more.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from services.common.sampling_params import SamplingParams

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
        self._stop = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]),
            skip_special_tokens=params.skip_special_tokens,
        )
        self.output_text = ""  # everything decoded so far (trimmed once a stop string hits)
        self._num_sent = 0  # chars of output_text already handed out
        self.stop_string: str | None = None

    def update(self, new_token_ids: list[int], finished: bool) -> DetokenizerUpdate:
        """Feed new tokens; returns the text that can be released now."""
        kept = None
        if self.stop_string is None:
            for count, token_id in enumerate(new_token_ids, 1):
                chunk = self._stream.step(self._tokenizer, token_id)
                if chunk:
                    start = len(self.output_text)
                    self.output_text += chunk
                    if self._check_stop(start):
                        kept = count
                        break
        done = finished or self.stop_string is not None
        release = len(self.output_text) if done else self._releasable()
        delta = self.output_text[self._num_sent : release]
        self._num_sent = max(self._num_sent, release)
        return DetokenizerUpdate(delta, self.stop_string, kept)

    def _check_stop(self, start: int) -> bool:
        """Look for a stop string overlapping the text added at `start`."""
        if not self._stop:
            return False
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.output_text.find(stop, max(0, start - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self.output_text = self.output_text[: index + len(stop) if self._include_stop else index]
        self.stop_string = stop
        return True

    def _releasable(self) -> int:
        """Length of text that cannot be the start of a stop string any more."""
        text = self.output_text
        held = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return len(text) - held


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
