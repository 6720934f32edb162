"""The streaming state machine for pythonic calls (Llama 3.2 / Llama 4, pythonic.py):
the whole reply is a Python list of calls with keyword arguments,
`[get_weather(city="Paris", days=3), get_time()]`, optionally inside Llama 4's
`<|python_start|>` / `<|python_end|>`. One PythonicCallStream reads one reply; its
docstring gives the rules.
"""

from __future__ import annotations

import json
import re

from services.frontend.tool_parsers import typed_value
from services.frontend.tool_parsers.base import (
    ParsedDelta,
    ToolCallDelta,
    ToolCallStream,
    tool_call_id,
)
from services.frontend.tool_parsers.markup import MAX_NAME_CHARS, skip_space

PYTHON_START = "<|python_start|>"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_KEYWORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPENERS, _CLOSERS = "([{", ")]}"


class _Malformed(Exception):
    pass


class _Value:
    """Where a keyword value ends: brackets and strings tracked as the text arrives."""

    def __init__(self, start: int) -> None:
        self.start = self.scan = start
        self.depth = 0
        self.quote: str | None = None  # the open string's quote: ' " ''' or """
        self.escaped = False

    def end(self, text: str, final: bool) -> int | None:
        """Index of the `,` / `)` that ends the value, or None while it has not come."""
        while self.scan < len(text):
            char = text[self.scan]
            if self.quote is not None:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif text.startswith(self.quote, self.scan):
                    self.scan += len(self.quote) - 1
                    self.quote = None
                elif (
                    len(self.quote) == 3 and not final and self.quote.startswith(text[self.scan :])
                ):
                    return None  # a partial closing triple quote: decide with more text
            elif char in "'\"":
                triple = text[self.scan : self.scan + 3]
                if len(triple) < 3 and not final:
                    return None  # '' could still become '''
                self.quote = char * 3 if triple == char * 3 else char
                self.scan += len(self.quote) - 1
            elif char in _OPENERS:
                self.depth += 1
            elif char in _CLOSERS and self.depth:
                self.depth -= 1
            elif char in ",)" and not self.depth:
                return self.scan
            self.scan += 1
        return None


class PythonicCallStream(ToolCallStream):
    """Rules (streamed and whole text alike, see base.py):
    - A reply that does not start with `[` (after whitespace and the optional tag) is plain
      content, as in vLLM's pythonic parser.
    - Each keyword value is read once it is complete (a `,` or `)` outside brackets and
      strings ends it), as JSON when it is JSON, else as a Python literal (ast.literal_eval:
      literals only, nothing is run); anything else is malformed.
    - A call is announced with its first complete keyword (or at its `)` when it has none),
      so text that merely looks like `[word(` is never taken for a call. The arguments are a
      JSON object written keyword by keyword: `{"KEY": VALUE`, then `, "KEY": VALUE`, then `}`.
    - Malformed text before the first call is announced: all of it is content; after a call
      was announced nothing can be taken back: the calls end as sent and parsing stops. Text
      after the closing `]` is dropped.
    """

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.mode = "start"  # start | name | keyword | value | after_value | between | raw | done
        self.name: str | None = None  # the call being read
        self.index = 0  # its index
        self.announced = False
        self.keys = 0  # keywords written in it
        self.keyword = ""
        self.value: _Value | None = None

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._advance(out, final=True)
        if self.mode not in ("raw", "done", "between"):
            self._malformed(out)  # cut short inside a call
        return out

    def _advance(self, out: ParsedDelta, final: bool) -> None:
        while True:
            mode = self.mode
            try:
                getattr(self, f"_step_{mode}")(out, final)
            except _Malformed:
                self._malformed(out)
            if self.mode == mode:  # no transition: wait for more text
                return

    def _malformed(self, out: ParsedDelta) -> None:
        if self._num_calls == 0 and not self.announced:
            self.mode = "raw"
            out.content += self.text
            self.pos = len(self.text)
        else:
            self.mode = "done"

    # ---- steps ---------------------------------------------------------------------------
    def _step_start(self, out: ParsedDelta, final: bool) -> None:
        rest = self.text.lstrip()
        if rest.startswith(PYTHON_START):
            rest = rest[len(PYTHON_START) :].lstrip()
        if rest.startswith("["):
            self.pos, self.mode = len(self.text) - len(rest) + 1, "name"
        elif final or not PYTHON_START.startswith(rest):
            raise _Malformed

    def _step_name(self, out: ParsedDelta, final: bool) -> None:
        index = skip_space(self.text, self.pos)
        found = _NAME.match(self.text, index)
        name = found.group() if found else ""
        after = skip_space(self.text, index + len(name))
        if len(name) > MAX_NAME_CHARS:
            raise _Malformed
        if after == len(self.text) and not final:
            return
        if not name or not self.text.startswith("(", after):
            raise _Malformed
        self.name, self.index, self.announced, self.keys = name, self._num_calls, False, 0
        self.pos, self.mode = after + 1, "keyword"

    def _step_keyword(self, out: ParsedDelta, final: bool) -> None:
        index = skip_space(self.text, self.pos)
        if self.text.startswith(")", index):
            self.pos = index + 1
            self._end_call(out)
            return
        found = _KEYWORD.match(self.text, index)
        keyword = found.group() if found else ""
        after = skip_space(self.text, index + len(keyword))
        if len(keyword) > MAX_NAME_CHARS:
            raise _Malformed
        if after == len(self.text) and not final:
            return
        if not keyword or not self.text.startswith("=", after):
            raise _Malformed
        self.keyword, self.value = keyword, _Value(after + 1)
        self.mode = "value"

    def _step_value(self, out: ParsedDelta, final: bool) -> None:
        end = self.value.end(self.text, final)
        if end is None:
            if final:
                raise _Malformed
            return
        found = typed_value.read_python_or_json(self.text[self.value.start : end].strip())
        written = None if found is typed_value.NOT_READ else typed_value.dumps(found)
        if written is None:
            raise _Malformed
        self._announce(out)
        separator = ", " if self.keys else "{"
        key = json.dumps(self.keyword, ensure_ascii=False)
        out.tool_calls.append(ToolCallDelta(self.index, arguments=f"{separator}{key}: {written}"))
        self.keys += 1
        self.pos, self.mode = end, "after_value"

    def _step_after_value(self, out: ParsedDelta, final: bool) -> None:
        index = skip_space(self.text, self.pos)
        if index == len(self.text):
            if final:
                raise _Malformed
            return
        if self.text[index] == ",":
            self.pos, self.mode = index + 1, "keyword"
        elif self.text[index] == ")":
            self.pos = index + 1
            self._end_call(out)
        else:
            raise _Malformed

    def _step_between(self, out: ParsedDelta, final: bool) -> None:
        index = skip_space(self.text, self.pos)
        if index == len(self.text):
            return
        if self.text[index] == "," and (self.max_calls is None or self._num_calls < self.max_calls):
            self.pos, self.mode = index + 1, "name"
        else:
            self.mode = "done"  # "]", the call limit, or anything else ends the calls

    def _step_raw(self, out: ParsedDelta, final: bool) -> None:
        out.content += self.text[self.pos :]
        self.pos = len(self.text)

    def _step_done(self, out: ParsedDelta, final: bool) -> None:
        return

    # ---- calls ---------------------------------------------------------------------------
    def _announce(self, out: ParsedDelta) -> None:
        if not self.announced:
            self.announced = True
            self._num_calls += 1
            out.tool_calls.append(ToolCallDelta(self.index, tool_call_id(), self.name, ""))

    def _end_call(self, out: ParsedDelta) -> None:
        first = not self.announced
        self._announce(out)
        out.tool_calls.append(ToolCallDelta(self.index, arguments="{}" if first else "}"))
        self.announced, self.mode = False, "between"
