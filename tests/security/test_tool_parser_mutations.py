"""Tool-call parsers under broken model output: every valid reply of every format cut at
every position, with characters flipped, and with markers inserted anywhere, fed whole
and in random chunks. No parser may raise, and the streamed deltas must assemble to what
the whole-text extraction gives (a client sees the same message either way)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.frontend.tool_parsers import get_tool_parser
from tests.frontend.tool_parser_cases import (
    REPLIES,
    TOOLS,
    assembled,
    parser_name,
    summary,
)

CASES = sorted(REPLIES)
MARKERS = [
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|python_start|>",
    "<|python_tag|>",
    "functools[",
    "[",
    "]",
    "(",
    ")",
    "{",
    "}",
    '"',
    "'",
    '"""',
    "\\",
    ",",
    "=",
    "\n",
]


def _check(case: str, text: str, sizes, max_calls=None) -> None:
    parser = get_tool_parser(parser_name(case))(max_calls=max_calls, tools=TOOLS)
    whole = summary(parser.extract(text))
    assert assembled(parser, text, sizes) == whole, (text, sizes)
    assert assembled(parser, text, [1] * len(text)) == whole, text
    content, calls = whole
    if not calls:  # nothing was read as a call: the text comes back as it was
        assert (content or "") == text, (text, content)


@pytest.mark.parametrize("case", CASES)
def test_every_truncation(case):
    text = "".join(REPLIES[case])
    rng = random.Random(7)
    for cut in range(len(text) + 1):
        _check(case, text[:cut], [rng.randint(1, 12) for _ in range(cut)])


@pytest.mark.parametrize("case", CASES)
def test_every_single_character_flip(case):
    text = "".join(REPLIES[case])
    rng = random.Random(11)
    for i in range(len(text)):
        flipped = text[:i] + rng.choice("x{}[]()<>\"'\\,=:\n ") + text[i + 1 :]
        _check(case, flipped, [rng.randint(1, 12) for _ in range(len(text))])


@settings(max_examples=300, deadline=None)
@given(
    case=st.sampled_from(CASES),
    edits=st.lists(
        st.tuples(
            st.floats(0, 1),
            st.sampled_from(["insert", "delete", "flip"]),
            st.sampled_from(MARKERS) | st.text(max_size=3),
        ),
        max_size=4,
    ),
    cut=st.floats(0, 1),
    sizes=st.lists(st.integers(1, 20), min_size=1, max_size=60),
    max_calls=st.sampled_from([None, 1]),
)
def test_random_mutations_never_raise_and_stream_like_whole_text(
    case, edits, cut, sizes, max_calls
):
    text = "".join(REPLIES[case])
    for where, kind, piece in edits:
        i = int(where * len(text))
        if kind == "insert":
            text = text[:i] + piece + text[i:]
        elif kind == "delete":
            text = text[:i] + text[i + len(piece) + 1 :]
        else:
            text = text[:i] + piece + text[i + len(piece) :]
    text = text[: max(1, int(cut * len(text)) + 1)] if cut < 0.5 else text
    _check(case, text, sizes, max_calls)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted({parser_name(c) for c in CASES})),
    text=st.lists(st.sampled_from(MARKERS) | st.text(max_size=4), max_size=20).map("".join),
    sizes=st.lists(st.integers(1, 8), min_size=1, max_size=40),
)
def test_arbitrary_text_never_raises(name, text, sizes):
    parser = get_tool_parser(name)(tools=TOOLS)
    whole = summary(parser.extract(text))
    assert assembled(parser, text, sizes) == whole
