"""The streaming state machine for Qwen3-Coder's XML calls (qwen3_coder.py):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

One XmlCallStream reads one reply; its docstring gives the rules.
"""

from __future__ import annotations

import json
from typing import ClassVar

from services.frontend.marker_hold import held_marker_suffix
from services.frontend.tool_parsers import parameter_schema, typed_value
from services.frontend.tool_parsers.base import (
    ParsedDelta,
    ToolCallDelta,
    ToolCallStream,
    tool_call_id,
)
from services.frontend.tool_parsers.blank_prefix import BlankPrefix
from services.frontend.tool_parsers.markup import MAX_NAME_CHARS, skip_space

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"


class _Malformed(Exception):
    pass


class _Call:
    def __init__(self, index: int, name: str, schema: dict | None) -> None:
        self.index = index
        self.parameters = schema or {}
        self.properties = parameter_schema.properties(schema)
        self.num_params = 0
        self.key: str | None = None  # the parameter being read
        self.streamed = False  # its value is sent as it arrives (a string)
        self.value_start = 0
        self.value_sent = 0  # for a streamed value: text index sent up to
        # where the search for the value's `</parameter>` resumes: text before it holds no
        # whole tag, so each character is searched about once however many tokens come
        self.end_search = 0
        self.newline_read = False  # the newline that may follow <parameter=KEY>


class XmlCallStream(ToolCallStream):
    """Rules (streamed and whole text alike, see base.py):
    - Text before the first `<tool_call>` is content, a possible partial marker held back;
      whitespace-only content is held back too (a message of only calls has content null).
    - A call is announced at `<function=NAME>`. Its arguments are a JSON object written
      parameter by parameter: `{"KEY": ` with the first, `, "KEY": ` with the next, `}` at
      `</function>`. A string-typed parameter's text is sent as it arrives (a possible partial
      `\n</parameter>` held back); any other value once its `</parameter>` is read, converted
      by the parameter's schema type (typed_value.py). One newline after `<parameter=KEY>` and
      one before `</parameter>` belong to the format, not to the value.
    - The first `</parameter>` ends a value (a value cannot contain that text).
    - Text between and after calls is dropped (hermes does the same).
    - Malformed markup before a call is announced: the text is content when no call came
      before, else dropped. After it is announced nothing can be taken back: the call ends
      with the arguments sent so far, and parsing stops.
    """

    def __init__(self, max_calls: int | None, tools: list[dict]) -> None:
        super().__init__(max_calls)
        self.schemas = {t["name"]: t.get("parameters") for t in tools if "name" in t}
        self.mode = "content"  # content | open | params | value | between | raw | done
        self.content_sent = 0
        self.blank = BlankPrefix()
        self.call: _Call | None = None

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._advance(out, final=True)
        if self.mode == "content":
            self._content(out, len(self.text), force=True)
        elif self.mode == "open":
            self._malformed(out)
        return out

    def _advance(self, out: ParsedDelta, final: bool) -> None:
        while True:
            mode = self.mode
            try:
                self._STEPS[mode](self, out, final)
            except _Malformed:
                self._malformed(out)
            if self.mode == mode:  # no transition: wait for more text
                return

    # ---- outside calls -----------------------------------------------------------------
    def _scan_content(self, out: ParsedDelta, final: bool) -> None:
        index = self.text.find(CALL_START, self.pos)
        if index < 0:
            held = 0 if final else held_marker_suffix(self.text, CALL_START)
            self._content(out, len(self.text) - held)
            self.pos = max(self.pos, len(self.text) - held)
            return
        self._content(out, index)
        self.mode, self.pos = "open", index + len(CALL_START)

    def _scan_between(self, out: ParsedDelta, final: bool) -> None:
        if self.max_calls is not None and self._num_calls >= self.max_calls:
            self.mode = "done"
            return
        index = self.text.find(CALL_START, self.pos)
        if index < 0:
            self.pos = max(self.pos, len(self.text) - held_marker_suffix(self.text, CALL_START))
            return
        self.mode, self.pos = "open", index + len(CALL_START)

    def _raw(self, out: ParsedDelta, final: bool) -> None:
        self._content(out, len(self.text), force=True)

    def _done(self, out: ParsedDelta, final: bool) -> None:
        return

    def _content(self, out: ParsedDelta, end: int, force: bool = False) -> None:
        """Send text[content_sent:end] unless all content so far is whitespace."""
        if end <= self.content_sent or (not force and not self.blank.has_text(self.text, end)):
            return
        out.content += self.text[self.content_sent : end]
        self.content_sent = end

    def _malformed(self, out: ParsedDelta) -> None:
        if self.call is None and self._num_calls == 0:
            self.mode = "raw"
            self._content(out, len(self.text), force=True)
        else:
            self.mode = "done"

    # ---- markup ------------------------------------------------------------------------
    def _tag(self, prefix: str, final: bool) -> str | None:
        """After optional whitespace, `prefix` NAME `>`: NAME (self.pos moves past it), None
        while it may still come; _Malformed when it cannot."""
        index = skip_space(self.text, self.pos)
        rest = self.text[index : index + len(prefix)]
        if not rest.startswith(prefix):
            if final or not prefix.startswith(rest):
                raise _Malformed
            return None
        start = index + len(prefix)
        end = self.text.find(">", start, start + MAX_NAME_CHARS + 1)
        name = self.text[start : end if end >= 0 else start + MAX_NAME_CHARS + 1]
        if "<" in name or "\n" in name or (end >= 0 and not name.strip()):
            raise _Malformed
        if end < 0:
            if final or len(name) > MAX_NAME_CHARS:
                raise _Malformed
            return None
        self.pos = end + 1
        return name.strip()

    def _closing(self, tag: str, final: bool) -> bool | None:
        """After optional whitespace, `tag`: True (self.pos moves past it), None while it may
        still come, False when something else is there."""
        index = skip_space(self.text, self.pos)
        rest = self.text[index : index + len(tag)]
        if rest == tag:
            self.pos = index + len(tag)
            return True
        return None if not final and tag.startswith(rest) else False

    # ---- inside a call -----------------------------------------------------------------
    def _scan_open(self, out: ParsedDelta, final: bool) -> None:
        name = self._tag(FUNCTION_START, final)
        if name is None:
            return
        self.call = _Call(self._num_calls, name, self.schemas.get(name))
        self._num_calls += 1
        out.tool_calls.append(ToolCallDelta(self.call.index, tool_call_id(), name, ""))
        self.mode = "params"

    def _scan_params(self, out: ParsedDelta, final: bool) -> None:
        call = self.call
        ended = self._closing(FUNCTION_END, final)
        if ended is None:  # what is there so far could begin either tag
            return
        if ended:
            self._arguments(out, "}" if call.num_params else "{}")
            self.call, self.mode = None, "between"
            return
        key = self._tag(PARAMETER_START, final)
        if key is None:
            return
        value_types = parameter_schema.types(call.properties.get(key, {}), call.parameters)
        call.key, call.streamed = key, value_types == ["string"]
        call.value_start = call.value_sent = call.end_search = self.pos
        call.newline_read = False
        self.mode = "value"

    def _scan_value(self, out: ParsedDelta, final: bool) -> None:
        call = self.call
        if not call.newline_read:
            if self.pos == len(self.text) and not final:
                return
            if self.text.startswith("\n", self.pos):  # the format's, after the opening tag
                call.value_start = call.value_sent = call.end_search = self.pos = self.pos + 1
            call.newline_read = True
        end = self._value_end(call)
        if end < 0:
            if call.streamed and not final:
                held = max(
                    held_marker_suffix(self.text, "\n" + PARAMETER_END),
                    held_marker_suffix(self.text, PARAMETER_END),
                )
                self._send_string(out, max(call.value_sent, len(self.text) - held), False)
            if final:
                self.mode = "done"  # cut short: the arguments sent so far stand
            return
        value_end = end - 1 if end > call.value_start and self.text[end - 1] == "\n" else end
        if call.streamed:
            self._send_string(out, value_end, True)
        else:
            self._key(out)
            value = self.text[call.value_start : value_end]
            properties = call.properties.get(call.key, {})
            value_types = parameter_schema.types(properties, call.parameters)
            self._arguments(out, typed_value.to_json(value, value_types))
        call.num_params += 1
        call.key, self.pos, self.mode = None, end + len(PARAMETER_END), "params"

    def _value_end(self, call: _Call) -> int:
        """Index of the value's `</parameter>`, or -1 while it has not come."""
        end = self.text.find(PARAMETER_END, call.end_search)
        if end < 0:
            call.end_search = max(call.end_search, len(self.text) - len(PARAMETER_END) + 1)
        return end

    def _send_string(self, out: ParsedDelta, end: int, closed: bool) -> None:
        call = self.call
        if call.value_sent == call.value_start and (end > call.value_start or closed):
            self._key(out)
            self._arguments(out, '"')
        piece = self.text[call.value_sent : end]
        call.value_sent = max(call.value_sent, end)
        text = json.dumps(piece, ensure_ascii=False)[1:-1] + ('"' if closed else "")
        self._arguments(out, text)

    def _key(self, out: ParsedDelta) -> None:
        call = self.call
        separator = ", " if call.num_params else "{"
        self._arguments(out, f"{separator}{json.dumps(call.key, ensure_ascii=False)}: ")

    def _arguments(self, out: ParsedDelta, text: str) -> None:
        if text:
            out.tool_calls.append(ToolCallDelta(self.call.index, arguments=text))

    _STEPS: ClassVar[dict] = {
        "content": _scan_content,
        "open": _scan_open,
        "params": _scan_params,
        "value": _scan_value,
        "between": _scan_between,
        "raw": _raw,
        "done": _done,
    }
