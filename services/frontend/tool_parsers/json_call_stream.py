"""The streaming state machine for formats whose calls are JSON objects
`{"name": ..., "arguments": {...}}` found by a marker (hermes' `<tool_call>`, llama3's
leading `{`). One JsonCallStream reads one reply; its docstring gives the rules.
"""

from __future__ import annotations

import json

from services.frontend.tool_parsers.base import (
    ParsedDelta,
    ToolCallDelta,
    ToolCallStream,
    tool_call_id,
)
from services.frontend.tool_parsers.blank_prefix import BlankPrefix
from services.frontend.tool_parsers.json_scanner import JsonError, JsonScanner


class _Call:
    def __init__(self, index: int, name: str | None = None) -> None:
        self.index = index
        self.name = name  # known before the JSON (mistral's NAME[ARGS]): the JSON is the arguments
        self.scanner = JsonScanner()
        self.started = False  # saw the opening "{"
        self.announced = False
        self.args_key: str | None = None
        self.args_sent = 0


class JsonCallStream(ToolCallStream):
    """Subclasses say where calls start: `find_first_call` / `find_next_call`.

    Rules (the same for streamed and whole text, see base.py):
    - Text before the first call is content; a suffix that could still become a marker is held
      back, and so is whitespace-only content (a message of only calls has content null).
    - A call is announced (id, name, empty arguments) once its `name` string is complete; its
      arguments follow as canonical JSON fragments (json_scanner.py) as they are read; a call
      without arguments gets "{}".
    - Text between and after calls is not content (vLLM's hermes parser drops it too).
    - Malformed JSON before a call is announced: the text is content, as if there were no call
      (when no call came before) or dropped (after one). After it is announced, nothing can be
      taken back: the call ends with the arguments sent so far, and parsing stops.
    """

    argument_keys: tuple[str, ...] = ("arguments",)
    new_call_id = staticmethod(tool_call_id)
    # A format whose calls start at a marker anywhere in the text (hermes' <tool_call>):
    # content without the marker's first character, after content was sent and with
    # nothing held back, passes straight through (most tokens of a reply).
    start_marker: str | None = None

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.mode = "content"  # content | call | between | raw | done
        self.content_sent = 0
        self.blank = BlankPrefix()
        self.call: _Call | None = None

    # ---- where calls start (per format) ----------------------------------------------------
    def find_first_call(self, final: bool) -> tuple | int:
        """(content_end, json_start) of the first call in self.text from self.pos, or the
        safe content end when there is none (yet). A format that names the call before its
        JSON returns (content_end, json_start, name): the JSON is then the arguments."""
        raise NotImplementedError

    def find_next_call(self, final: bool) -> tuple | int:
        """(_, json_start[, name]) of the next call after one ended, or where to resume
        scanning."""
        raise NotImplementedError

    # ---- driving -----------------------------------------------------------------------
    def feed(self, text: str) -> ParsedDelta:
        marker = self.start_marker
        if (
            marker is not None
            and self.mode == "content"
            and 0 < self.content_sent == len(self.text)
            and marker[0] not in text
        ):
            self.text += text
            self.content_sent = self.pos = len(self.text)
            return ParsedDelta(content=text)
        return super().feed(text)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._advance(out, final=True)
        if self.mode == "call" and not self.call.announced:
            self._malformed(out)
        elif self.mode == "content":
            self._content(out, len(self.text), force=True)
        return out

    def _advance(self, out: ParsedDelta, final: bool) -> None:
        while True:
            mode = self.mode
            if mode == "content":
                self._scan_content(out, final)
            elif mode == "call":
                self._scan_call(out)
            elif mode == "between":
                self._scan_between(final)
            elif mode == "raw":
                self._content(out, len(self.text), force=True)
            if self.mode == mode:  # no transition: wait for more text
                return

    def _scan_content(self, out: ParsedDelta, final: bool) -> None:
        found = self.find_first_call(final)
        if isinstance(found, int):
            self._content(out, found)
            self.pos = max(self.pos, found)
            return
        self._content(out, found[0])
        self._start_call(*found[1:])

    def _scan_between(self, final: bool) -> None:
        if self.max_calls is not None and self._num_calls >= self.max_calls:
            self.mode = "done"
            return
        found = self.find_next_call(final)
        if isinstance(found, int):
            self.pos = max(self.pos, found)
            return
        self._start_call(*found[1:])

    def _content(self, out: ParsedDelta, end: int, force: bool = False) -> None:
        """Send text[content_sent:end] unless all content so far is whitespace."""
        if end <= self.content_sent:
            return
        if not force and not self.blank.has_text(self.text, end):
            return
        out.content += self.text[self.content_sent : end]
        self.content_sent = end

    def _start_call(self, json_start: int, name: str | None = None) -> None:
        self.call = _Call(self._num_calls, name)
        self.mode, self.pos = "call", json_start

    # ---- inside a call ---------------------------------------------------------------------
    def _scan_call(self, out: ParsedDelta) -> None:
        call = self.call
        try:
            while self.pos < len(self.text) and not call.scanner.done:
                char = self.text[self.pos]
                if not call.started:
                    if char.isspace():
                        self.pos += 1
                        continue
                    if char != "{":
                        raise JsonError("a tool call must be a JSON object")
                    call.started = True
                call.scanner.feed(char)
                self.pos += 1
                self._announce(call, out)
        except JsonError:
            self._malformed(out)
            return
        self._send_arguments(call, out)
        if call.scanner.done:
            self._end_call(call, out)

    def _announce(self, call: _Call, out: ParsedDelta) -> None:
        if call.name is not None:
            self._announce_named(call, out)
            return
        scanner = call.scanner
        if call.args_key is None:
            in_progress = scanner.member if scanner.member in self.argument_keys else None
            done = next((k for k in self.argument_keys if k in scanner.members), None)
            call.args_key = in_progress or done
        if call.announced or "name" not in scanner.members:
            return
        start, end = scanner.members["name"]
        name = json.loads(scanner.out[start:end])
        if not isinstance(name, str) or not name:
            raise JsonError("a tool call's name must be a non-empty string")
        call.announced = True
        self._num_calls += 1
        out.tool_calls.append(ToolCallDelta(call.index, self.new_call_id(), name, ""))

    def _announce_named(self, call: _Call, out: ParsedDelta) -> None:
        """A call named before its JSON is announced at the arguments' opening brace."""
        if not call.announced:
            call.announced, call.args_key = True, ""
            self._num_calls += 1
            out.tool_calls.append(ToolCallDelta(call.index, self.new_call_id(), call.name, ""))

    def _send_arguments(self, call: _Call, out: ParsedDelta) -> None:
        if not call.announced or call.args_key is None:
            return
        scanner = call.scanner
        if call.name is not None:
            start, end = 0, scanner.length
        elif call.args_key in scanner.members:
            start, end = scanner.members[call.args_key]
        else:
            start, end = scanner.member_start, scanner.length
        fragment = scanner.out[start + call.args_sent : end]
        if fragment:
            call.args_sent += len(fragment)
            out.tool_calls.append(ToolCallDelta(call.index, arguments=fragment))

    def _end_call(self, call: _Call, out: ParsedDelta) -> None:
        if not call.announced:  # a whole object without a name
            self._malformed(out)
            return
        if call.args_key is None:
            out.tool_calls.append(ToolCallDelta(call.index, arguments="{}"))
        self.call, self.mode = None, "between"

    def _malformed(self, out: ParsedDelta) -> None:
        call = self.call
        if call is not None and call.announced:
            self._send_arguments(call, out)
            self.mode = "done"
        elif self._num_calls == 0:
            self.mode = "raw"  # no call at all: the whole text is content
            self._content(out, len(self.text), force=True)
        else:
            self.mode = "done"
