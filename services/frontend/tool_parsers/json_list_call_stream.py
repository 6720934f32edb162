"""Calls written as a JSON list of `{"name": ..., "arguments": {...}}` objects after a
marker (phi4_mini_json's `functools[`, mistral's `[TOOL_CALLS][`): content before the
marker, then objects separated by commas up to the closing `]`; anything after it is
dropped, as text between hermes' blocks is (json_call_stream.py)."""

from __future__ import annotations

from services.frontend.marker_hold import held_marker_suffix
from services.frontend.tool_parsers.json_call_stream import JsonCallStream
from services.frontend.tool_parsers.markup import skip_space


class JsonListCallStream(JsonCallStream):
    """`marker` ends with the list's `[` (the first object follows it)."""

    marker = ""

    def find_first_call(self, final: bool) -> tuple | int:
        index = self.text.find(self.marker, self.pos)
        if index < 0:
            held = 0 if final else held_marker_suffix(self.text, self.marker)
            return len(self.text) - held
        return index, index + len(self.marker)

    def find_next_call(self, final: bool) -> tuple | int:
        index = skip_space(self.text, self.pos)
        if index == len(self.text):
            return index
        if self.text[index] == ",":
            return index + 1, index + 1  # the call scan skips the space before its "{"
        self.mode = "done"  # "]" or anything else ends the list
        return len(self.text)
