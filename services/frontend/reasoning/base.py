"""What every reasoning parser gives the chat endpoints: the reply split into the model's
thinking and its answer, whole or streamed, and the thinking's bounds in token ids for
the engine (a grammar applies to the answer only; a thinking budget ends the thinking).

A format is a pair of markers (`<think>` ... `</think>`); where the thinking begins is read
from the prompt (ReasoningParser.initial_mode). As for tool calls, `extract()` feeds the
whole text through the same stream a streamed reply uses, so the two always agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.reasoning_bounds import ReasoningBounds, ReasoningMode
from services.frontend.marker_hold import held_marker_suffix


@dataclass(slots=True)  # one per streamed token
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One choice's parser state: feed text deltas, get thinking and answer deltas.

    Whitespace around the thinking (the newlines after `<think>` and before `</think>`)
    and at the start of the answer is dropped, so streamed and whole replies read alike;
    a partial marker at the end of a delta is held back until the next one settles it.
    """

    def __init__(self, start: str, end: str, mode: ReasoningMode) -> None:
        self.start, self.end = start, end
        self.mode = mode
        self.buffer = ""
        self.thinking_started = False  # some thinking text was released (no leading ws)
        self.answer_started = False  # some answer text was released (no leading ws)

    @property
    def thinking(self) -> bool:
        return self.mode == ReasoningMode.THINKING

    def feed(self, text: str) -> ReasoningDelta:
        # Most tokens take the first return (this runs on every token): text past the
        # leading whitespace, with nothing held back, that cannot start or end a marker
        # (thinking: no end-marker first character, no trailing whitespace that may
        # precede the marker) goes out as it is.
        if text and not self.buffer:
            if self.mode == ReasoningMode.ANSWER and self.answer_started:
                return ReasoningDelta(content=text)
            if (
                self.mode == ReasoningMode.THINKING
                and self.thinking_started
                and self.end[0] not in text
                and not text[-1].isspace()
            ):
                return ReasoningDelta(reasoning=text)
        self.buffer += text
        delta = ReasoningDelta()
        if self.mode == ReasoningMode.OPTIONAL:
            self._decide(final=False)
        if self.mode == ReasoningMode.THINKING:
            self._think(delta, final=False)
        if self.mode == ReasoningMode.ANSWER:
            self._answer(delta)
        return delta

    def finish(self) -> ReasoningDelta:
        """The model stopped: what was held back is released (thinking cut short by a
        length limit stays thinking)."""
        delta = ReasoningDelta()
        if self.mode == ReasoningMode.OPTIONAL:
            self._decide(final=True)
        if self.mode == ReasoningMode.THINKING:
            self._think(delta, final=True)
        if self.mode == ReasoningMode.ANSWER:
            self._answer(delta)
        return delta

    def _decide(self, final: bool) -> None:
        """OPTIONAL: thinking if the reply opens with the start marker, else an answer."""
        head = self.buffer.lstrip()
        if head.startswith(self.start):
            self.buffer = head[len(self.start) :]
            self.mode = ReasoningMode.THINKING
        elif final or not self.start.startswith(head):
            self.mode = ReasoningMode.ANSWER
        # else: only whitespace or a prefix of the marker so far: wait

    def _think(self, delta: ReasoningDelta, final: bool) -> None:
        if not self.thinking_started and not self._opening(final):
            return  # the reply may still be opening the block the prompt opened
        index = self.buffer.find(self.end)
        if index >= 0:
            delta.reasoning += self._thought(self.buffer[:index].rstrip())
            self.buffer = self.buffer[index + len(self.end) :]
            self.mode = ReasoningMode.ANSWER
            return
        if final:
            delta.reasoning += self._thought(self.buffer.rstrip())
            self.buffer = ""
            return
        held = held_marker_suffix(self.buffer, self.end)
        ready = self.buffer[: len(self.buffer) - held]
        released = ready.rstrip()  # trailing whitespace may precede the end marker
        delta.reasoning += self._thought(released)
        self.buffer = self.buffer[len(released) :]

    def _opening(self, final: bool) -> bool:
        """Before any thinking went out: a start marker the model wrote although the
        thinking had begun (DeepSeek-R1 opens it either way) is dropped; False while the
        reply so far could still be one."""
        head = self.buffer.lstrip()
        if head.startswith(self.start):
            self.buffer = head[len(self.start) :]
        elif head and not final and self.start.startswith(head):
            return False
        return True

    def _thought(self, text: str) -> str:
        if not self.thinking_started:
            text = text.lstrip()
            self.thinking_started = bool(text)
        return text

    def _answer(self, delta: ReasoningDelta) -> None:
        text, self.buffer = self.buffer, ""
        if not self.answer_started:
            text = text.lstrip()
            self.answer_started = bool(text)
        delta.content += text


class ReasoningParser:
    """A model family's thinking format. Subclasses set the markers, the text the engine
    writes when a thinking budget is spent, and what a reply does when the prompt does
    not say (`default_mode`)."""

    name: str = ""
    start: str = "<think>"
    end: str = "</think>"
    forced_end: str = "\n</think>\n\n"
    default_mode: ReasoningMode = ReasoningMode.OPTIONAL

    def initial_mode(self, prompt: str) -> ReasoningMode:
        """Where the reply begins, from the prompt's end (the chat template's doing): a
        template that opened `<think>` (thinking-only checkpoints) starts the reply inside
        it, one that wrote a closed, empty block (Qwen3's enable_thinking=false, SmolLM3's
        /no_think) in the answer; otherwise the format decides (the model may open the
        block itself, or, for DeepSeek-R1, everything before `</think>` is thinking)."""
        tail = prompt.rstrip()
        if tail.endswith(self.start):
            return ReasoningMode.THINKING  # the template opened the thinking
        if tail.endswith(self.end):
            return ReasoningMode.ANSWER  # it wrote a closed block: thinking is off
        return self.default_mode

    def stream(self, prompt: str) -> ReasoningStream:
        return ReasoningStream(self.start, self.end, self.initial_mode(prompt))

    def extract(self, text: str, prompt: str = "") -> tuple[str | None, str]:
        """(thinking or None when there was none, answer) of a whole reply."""
        stream = self.stream(prompt)
        first, last = stream.feed(text), stream.finish()
        reasoning = first.reasoning + last.reasoning
        return (reasoning if stream.thinking_started else None), first.content + last.content

    def bounds(self, tokenizer, prompt: str) -> ReasoningBounds:
        """The thinking's bounds in the model's token ids, for the engine."""

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return ReasoningBounds(
            mode=self.initial_mode(prompt),
            start_token_ids=ids(self.start),
            end_token_ids=ids(self.end),
            forced_end_token_ids=ids(self.forced_end),
        )

    def marks_are_special(self, tokenizer) -> bool:
        """Whether the markers are special tokens, which detokenizing must then keep."""
        special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        return self.start in special or self.end in special
