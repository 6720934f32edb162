"""Mistral tool calls after the `[TOOL_CALLS]` token, in either of its two forms:

- a JSON list `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers before
  v11: Mistral-7B-Instruct-v0.3 and its peers);
- `[TOOL_CALLS]NAME[ARGS]{...}` once per call (v11 and later: Mistral Small 3.2, Magistral,
  Devstral; v13 may put `[CALL_ID]ID` before `[ARGS]`, not kept: ids are ours).

The form is read from the first call. Ids are 9 letters and digits: Mistral's templates
refuse any other shape when the calls come back in the conversation.
"""

from __future__ import annotations

import random
import re
import string

from services.frontend.tool_parsers.base import ToolCallStream, ToolParser
from services.frontend.tool_parsers.grammar import arguments_schema, lark_string, tool_rules
from services.frontend.tool_parsers.json_list_call_stream import JsonListCallStream
from services.frontend.tool_parsers.markup import MAX_NAME_CHARS, skip_space

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_ID = re.compile(r"[A-Za-z0-9]*")
_ALPHANUMERIC = string.ascii_letters + string.digits
_random = random.SystemRandom()


def mistral_call_id() -> str:
    return "".join(_random.choice(_ALPHANUMERIC) for _ in range(9))


class MistralCallStream(JsonListCallStream):
    marker = TOOL_CALLS
    new_call_id = staticmethod(mistral_call_id)

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.form: str | None = None  # "list" or "named", from the first call

    def find_first_call(self, final: bool) -> tuple | int:
        found = super().find_first_call(final)
        if isinstance(found, int):
            return found
        content_end, after = found
        body = skip_space(self.text, after)
        if body == len(self.text) and not final:
            return content_end  # hold the marker until its form shows
        if self.text.startswith("[", body):
            self.form = "list"
            return content_end, body + 1
        header = self._header(body, final)
        if header is None:
            return content_end  # wait for the rest of NAME[ARGS]
        if header is False:
            self.mode = "raw"  # not a call: all of it is content
            return len(self.text)
        self.form = "named"
        return (content_end, *header)

    def find_next_call(self, final: bool) -> tuple | int:
        if self.form == "list":
            return super().find_next_call(final)
        index = skip_space(self.text, self.pos)
        rest = self.text[index:]
        if not rest.startswith(TOOL_CALLS):
            if final or not TOOL_CALLS.startswith(rest):
                self.mode = "done"  # anything but another call ends the calls
                return len(self.text)
            return index
        header = self._header(index + len(TOOL_CALLS), final)
        if header is None:
            return index
        if header is False:
            self.mode = "done"
            return len(self.text)
        return (index, *header)

    def _header(self, start: int, final: bool) -> tuple[int, str] | bool | None:
        """NAME[ARGS] (or NAME[CALL_ID]ID[ARGS]) at `start`: (json_start, name), None while
        it may still come, False when it cannot."""
        name = _NAME.match(self.text, start).group()
        index = start + len(name)
        if name and self.text.startswith(CALL_ID, index):
            index += len(CALL_ID)
            index += len(_ID.match(self.text, index).group())
        if len(name) > MAX_NAME_CHARS or index - start > 2 * MAX_NAME_CHARS:
            return False
        rest = self.text[index:]
        if name and rest.startswith(ARGS):
            return index + len(ARGS), name
        if not final and (ARGS.startswith(rest) or CALL_ID.startswith(rest)):
            return None
        return False


class MistralToolParser(ToolParser):
    name = "mistral"

    def stream(self) -> ToolCallStream:
        return MistralCallStream(self.max_calls)

    def constraint_grammar(self, tools: list[dict], parallel: bool) -> str:
        """Either form (which one a model writes depends on its tokenizer's version)."""
        alternatives, rules = tool_rules(tools)
        named = [
            f"named_{i}: {lark_string(t['name'] + ARGS)} %json {arguments_schema(t)}"
            for i, t in enumerate(tools)
        ]
        named_call = " | ".join(f"named_{i}" for i in range(len(tools)))
        marker = lark_string(TOOL_CALLS)
        if parallel:
            listed = '"[" call (", " call)* "]"'
            calls = f"named_call ({marker} named_call)*"
        else:
            listed, calls = '"[" call "]"', "named_call"
        lines = [
            f"start: {marker} ({listed} | {calls})",
            f"call: {alternatives}",
            f"named_call: {named_call}",
            *rules,
            *named,
        ]
        return "\n".join(lines) + "\n"
