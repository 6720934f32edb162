"""Reasoning parsers: the thinking split from the answer exactly, whole and in any
chunking, with the starting point read from the prompt's end."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.reasoning_bounds import ReasoningMode
from services.frontend.reasoning import get_reasoning_parser
from services.frontend.reasoning.base import ReasoningStream
from services.frontend.reply_parser import ReplyParser
from services.frontend.tool_parsers import assemble, get_tool_parser

QWEN_OPEN = "<|im_start|>assistant\n"
QWEN_THINKING_ONLY = "<|im_start|>assistant\n<think>\n"
QWEN_NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"

CASES = [
    # (parser, prompt, reply, thinking, answer)
    (
        "qwen3",
        QWEN_OPEN,
        "<think>\nLet me add.\n2+2=4\n</think>\n\nIt is 4.",
        "Let me add.\n2+2=4",
        "It is 4.",
    ),
    ("qwen3", QWEN_OPEN, "It is 4.", None, "It is 4."),
    ("qwen3", QWEN_OPEN, "  \n<think>x</think>y", "x", "y"),
    ("qwen3", QWEN_THINKING_ONLY, "hmm, 4\n</think>\n\n4", "hmm, 4", "4"),
    ("qwen3", QWEN_NO_THINK, "4, <think> is text here", None, "4, <think> is text here"),
    ("qwen3", QWEN_OPEN, "<think>\nstill thinking when cut", "still thinking when cut", ""),
    ("qwen3", QWEN_OPEN, "<think></think>answer", None, "answer"),
    ("qwen3", QWEN_OPEN, "<thin", None, "<thin"),
    (
        "deepseek_r1",
        "<｜Assistant｜>",
        "no open tag</think>The answer",
        "no open tag",
        "The answer",
    ),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "a</thi", "a</thi", ""),
    ("deepseek_r1", "<｜Assistant｜>", "<think>\nhmm\n</think>\n\nanswer", "hmm", "answer"),
    ("deepseek_r1", "<｜Assistant｜>", "<thi", "<thi", ""),
    ("qwen3", QWEN_THINKING_ONLY, "<think>\nreopened</think>ok", "reopened", "ok"),
    ("mistral", "[INST]q[/INST]", "[THINK]ok so[/THINK]Yes.", "ok so", "Yes."),
    (
        "mistral",
        "[INST]q[/INST]",
        "Yes, [THINK] later is text.",
        None,
        "Yes, [THINK] later is text.",
    ),
]


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


@pytest.mark.parametrize(("name", "prompt", "reply", "thinking", "answer"), CASES)
def test_whole_reply_splits_exactly(name, prompt, reply, thinking, answer):
    assert get_reasoning_parser(name).extract(reply, prompt) == (thinking, answer)


@pytest.mark.parametrize(("name", "prompt", "reply", "thinking", "answer"), CASES)
@given(cuts=st.lists(st.integers(0, 200), max_size=12))
@settings(max_examples=60, deadline=None)
def test_any_chunking_streams_the_same_split(name, prompt, reply, thinking, answer, cuts):
    stream = get_reasoning_parser(name).stream(prompt)
    deltas = [stream.feed(chunk) for chunk in _chunks(reply, cuts)] + [stream.finish()]
    assert "".join(d.reasoning for d in deltas) == (thinking or "")
    assert "".join(d.content for d in deltas) == answer


def test_a_partial_end_marker_is_held_back_until_settled():
    stream = ReasoningStream("<think>", "</think>", ReasoningMode.THINKING)
    assert stream.feed("step one</thi").reasoning == "step one"
    delta = stream.feed("nk>done")
    assert (delta.reasoning, delta.content) == ("", "done")
    assert not stream.thinking


@pytest.mark.parametrize(
    ("prompt", "mode"),
    [
        (QWEN_OPEN, ReasoningMode.OPTIONAL),
        (QWEN_THINKING_ONLY, ReasoningMode.THINKING),
        (QWEN_NO_THINK, ReasoningMode.ANSWER),
    ],
)
def test_the_prompt_end_decides_where_the_reply_begins(prompt, mode):
    assert get_reasoning_parser("qwen3").initial_mode(prompt) == mode


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1, mistral, qwen3"):
        get_reasoning_parser("nope")


@given(cuts=st.lists(st.integers(0, 200), max_size=12))
@settings(max_examples=60, deadline=None)
def test_tool_calls_are_read_from_the_answer_only(cuts):
    """A call written while thinking is thought, not made."""
    reply = (
        '<think>maybe <tool_call>{"name": "a", "arguments": {}}</tool_call>?</think>'
        '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
    )
    parser = ReplyParser(
        get_reasoning_parser("qwen3").stream(QWEN_OPEN), get_tool_parser("hermes")().stream()
    )
    chunks = _chunks(reply, cuts)
    deltas = [parser.feed(c) for c in chunks[:-1]] + [parser.feed(chunks[-1], final=True)]
    assert "".join(d.reasoning for d in deltas) == (
        'maybe <tool_call>{"name": "a", "arguments": {}}</tool_call>?'
    )
    message = assemble(deltas)
    assert message.content is None
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("b", '{"x": 1}')]
