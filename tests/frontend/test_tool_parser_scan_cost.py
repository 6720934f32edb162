"""A long streamed reply costs the tool-call streams linear work: each character of a
qwen3_coder parameter value is searched for its closing tag about once, and each character
before a call is checked for being whitespace once, however many tokens it arrives in.
Counted (characters read), not timed."""

from __future__ import annotations

import json

import pytest

from services.frontend.tool_parsers import assemble
from services.frontend.tool_parsers.blank_prefix import BlankPrefix
from services.frontend.tool_parsers.hermes import HermesCallStream
from services.frontend.tool_parsers.xml_call_stream import PARAMETER_END, XmlCallStream

TOKENS = 20_000
TOKEN = "word "
TOOLS = [{"name": "f", "parameters": {"properties": {"s": {"type": "string"}, "n": {}}}}]


class _CountedXml(XmlCallStream):
    def __init__(self) -> None:
        super().__init__(None, TOOLS)
        self.searched = 0

    def _value_end(self, call) -> int:
        self.searched += len(self.text) - call.end_search
        return super()._value_end(call)


class _CountedBlank(BlankPrefix):
    read = 0

    def has_text(self, text: str, end: int) -> bool:
        if not self.seen:
            self.read += max(end - self.checked, 0)
        return super().has_text(text, end)


def _feed(stream, pieces: list[str]):
    deltas = [stream.feed(piece) for piece in pieces]
    return assemble([*deltas, stream.finish()])


@pytest.mark.parametrize("name", ["s", "n"])  # a string sent as it comes; a typed value
def test_a_long_parameter_value_is_searched_once_per_character(name):
    value = TOKEN * TOKENS
    head = f"<tool_call>\n<function=f>\n<parameter={name}>\n"
    tail = f"\n{PARAMETER_END}\n</function>\n</tool_call>"
    stream = _CountedXml()
    result = _feed(stream, [head, *[TOKEN] * TOKENS, tail])
    assert json.loads(result.tool_calls[0].arguments) == {name: value}
    # each token adds its own characters plus at most a tag's length re-read
    assert stream.searched <= len(value) + len(tail) + TOKENS * len(PARAMETER_END)


@pytest.mark.parametrize("stream_class", [XmlCallStream, HermesCallStream])
def test_whitespace_before_a_call_is_read_once_per_character(stream_class):
    stream = stream_class(None, TOOLS) if stream_class is XmlCallStream else stream_class()
    stream.blank = _CountedBlank()
    pieces = ["  \n"] * TOKENS + ["then words"]
    result = _feed(stream, pieces)
    assert result.content == "".join(pieces)
    assert stream.blank.read == len(result.content)
