"""The Anthropic Messages API's pure parts: a body converted into the chat request, parsed
deltas rendered as content blocks and stream events (which accumulate to the message),
stop reasons and usage, the error mapping, the stream's error event, and x-api-key."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from services.common.engine_errors import EngineOverloadedError, EngineUnavailableError
from services.common.outputs import CompletionOutput, RequestOutput
from services.frontend.anthropic.chat_request import to_chat_request
from services.frontend.anthropic.content_blocks import ContentBlocks
from services.frontend.anthropic.errors import to_anthropic_error
from services.frontend.anthropic.message_stream import message_events
from services.frontend.anthropic.message_tracker import MessageTracker
from services.frontend.anthropic.messages_request import CountTokensRequest, MessagesRequest
from services.frontend.api_key import ApiKey
from services.frontend.openai.errors import OverloadedError
from services.frontend.openai.exceptions import (
    AuthenticationError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestBodyTooLargeError,
)
from services.frontend.openai.serving_base import Job, Prompt
from services.frontend.reasoning import get_reasoning_parser
from services.frontend.reply_parser import ReplyParser
from services.frontend.request_limits import LimitExceededError
from services.frontend.tool_parsers import ParsedDelta, ToolCallDelta, get_tool_parser

TOOL = {"name": "get_time", "description": "now", "input_schema": {"type": "object"}}


def _request(**fields) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesRequest.model_validate(body | fields)


# ---- the conversion ---------------------------------------------------------------------
def test_a_tool_round_trip_becomes_chat_messages():
    request = _request(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}],
        messages=[
            {"role": "user", "content": "time?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "They want ", "signature": ""},
                    {"type": "thinking", "thinking": "the time.", "signature": "x"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"z": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"},
                    {"type": "text", "text": "and"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [
                            {"type": "text", "text": "no "},
                            {"type": "text", "text": "zone"},
                        ],
                        "is_error": True,
                    },
                ],
            },
        ],
    )
    chat = to_chat_request(request)
    dumped = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert dumped == [
        {
            "role": "system",
            "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "terse."}],
        },
        {"role": "user", "content": "time?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me look."}],
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"z": 1}'},
                }
            ],
            "reasoning_content": "They want the time.",
        },
        {"role": "tool", "content": "12:00", "tool_call_id": "toolu_1"},
        {"role": "user", "content": [{"type": "text", "text": "and"}]},
        {"role": "tool", "content": "Error: no zone", "tool_call_id": "toolu_2"},
    ]
    assert chat.max_tokens == 16 and chat.stream is False


def test_an_assistant_turn_of_calls_only_has_no_content():
    call = {"type": "tool_use", "id": "t", "name": "get_time", "input": {}}
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [RESULT]},
    ]
    assistant = to_chat_request(_request(messages=messages)).messages[1]
    assert assistant.content is None and assistant.tool_calls[0].function.arguments == "{}"


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def test_consecutive_same_role_messages_become_one():
    call = {"type": "tool_use", "id": "t1", "name": "get_time", "input": {}}
    messages = [
        {"role": "user", "content": "one"},
        {"role": "user", "content": [{"type": "text", "text": "two"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "a", "signature": ""}]},
        {"role": "assistant", "content": [{"type": "text", "text": "b"}, call]},
        {
            "role": "user",
            "content": [{**RESULT, "tool_use_id": "t1"}, {"type": "text", "text": "x"}],
        },
        {"role": "user", "content": "y"},
    ]
    dumped = [
        m.model_dump(exclude_none=True)
        for m in to_chat_request(_request(messages=messages)).messages
    ]
    assert dumped == [
        {"role": "user", "content": [_text("one"), _text("\n\n"), _text("two")]},
        {
            "role": "assistant",
            "content": [_text("b")],
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                }
            ],
            "reasoning_content": "a",
        },
        {"role": "tool", "content": "r", "tool_call_id": "t1"},  # results first, then the text
        {"role": "user", "content": [_text("x"), _text("\n\n"), _text("y")]},
    ]
    results = [{"role": "user", "content": [{**RESULT, "tool_use_id": i}]} for i in ("a", "b")]
    tools_only = to_chat_request(_request(messages=results)).messages
    assert [(m.role, m.tool_call_id) for m in tools_only] == [("tool", "a"), ("tool", "b")]


def test_a_final_assistant_message_is_refused_as_a_prefill():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "{"}]
    with pytest.raises(InvalidRequestError) as info:
        to_chat_request(_request(messages=messages))
    assert "messages[1]" in str(info.value) and "prefilling" in str(info.value)
    counted = to_chat_request(
        CountTokensRequest.model_validate({"model": "m", "messages": messages})
    )
    assert counted.messages[-1].role == "assistant"  # counting renders it as it is


def test_sampling_tools_and_choices_map_to_the_chat_fields():
    chat = to_chat_request(
        _request(
            stop_sequences=["END"],
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            stream=True,
            metadata={"user_id": "u"},
            tools=[TOOL, {**TOOL, "name": "other", "type": "custom"}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        )
    )
    assert (chat.stop, chat.temperature, chat.top_p, chat.top_k) == (["END"], 0.5, 0.9, 40)
    assert chat.stream and chat.tool_choice == "required" and chat.parallel_tool_calls is False
    function = chat.tools[0].function
    assert (function.name, function.description, function.parameters) == (
        "get_time",
        "now",
        {"type": "object"},
    )
    for choice, expected in (({"type": "auto"}, "auto"), ({"type": "none"}, "none")):
        converted = to_chat_request(_request(tools=[TOOL], tool_choice=choice))
        assert converted.tool_choice == expected and converted.parallel_tool_calls is True
    named = to_chat_request(
        _request(tools=[TOOL], tool_choice={"type": "tool", "name": "get_time"})
    )
    assert named.tool_choice.function.name == "get_time"


def test_thinking_maps_to_the_template_switch_and_the_budget():
    enabled = to_chat_request(_request(thinking={"type": "enabled", "budget_tokens": 8}))
    assert enabled.chat_template_kwargs == {"enable_thinking": True}
    assert enabled.thinking_token_budget == 8
    disabled = to_chat_request(_request(thinking={"type": "disabled"}))
    assert disabled.chat_template_kwargs == {"enable_thinking": False}
    assert disabled.thinking_token_budget is None
    adaptive = to_chat_request(_request(thinking={"type": "adaptive"}))
    assert adaptive.chat_template_kwargs == {"enable_thinking": True}
    assert adaptive.thinking_token_budget is None
    assert to_chat_request(_request()).chat_template_kwargs is None


TEXT_A = {"type": "text", "text": "a"}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
USE = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "t", "content": "r"}


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (
            {"messages": [{"role": "assistant", "content": [TEXT_A, IMAGE]}]},
            ("messages[0].content[1]", "images are not supported in an assistant message"),
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            ("messages[0].content[0]", "documents"),
        ),
        (
            {"messages": [{"role": "user", "content": [{**RESULT, "content": [IMAGE]}]}]},
            ("messages[0].content[0].content[0]", "images"),
        ),
        (
            {"messages": [{"role": "user", "content": [USE]}]},
            ("messages[0].content[0]", "tool_use"),
        ),
        (
            {"messages": [{"role": "assistant", "content": [RESULT]}]},
            ("messages[0].content[0]", "tool_result"),
        ),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            ("tools[0]", "web_search_20250305"),
        ),
        ({"tools": [{"name": "f"}]}, ("tools[0].input_schema",)),
        ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, ("tool_choice.name",)),
        ({"thinking": {"type": "enabled"}}, ("thinking.budget_tokens", "required")),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 16}},
            ("thinking.budget_tokens", "max_tokens"),
        ),
    ],
)
def test_what_has_no_chat_equivalent_is_refused_by_name(fields, words):
    with pytest.raises(InvalidRequestError) as info:
        to_chat_request(_request(**fields))
    error = to_anthropic_error(info.value)
    assert (error.status, error.type) == (400, "invalid_request_error")
    for word in words:
        assert word in error.message


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": [{"role": "user", "content": "x"}]},  # no max_tokens
        {"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
        {"model": "m", "max_tokens": 4, "messages": []},
        {"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": []}]},
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "video"}]}],
        },
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
            "tool_choice": {"type": "sometimes"},
        },
        {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "top_p": 2},
    ],
)
def test_malformed_bodies_fail_validation(body):
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate(body)


def test_count_tokens_takes_the_conversation_without_max_tokens():
    request = CountTokensRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "enabled", "budget_tokens": 99},
        }
    )
    chat = to_chat_request(request)
    assert chat.max_tokens is None and chat.thinking_token_budget == 99


# ---- content blocks and stream events ---------------------------------------------------
def _accumulate(events: list[dict]) -> list[dict]:
    """What a client rebuilds from the events (the anthropic SDK's accumulation)."""
    blocks: list[dict] = []
    json_text: dict[int, str] = {}
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                index = event["index"]
                json_text[index] = json_text.get(index, "") + delta["partial_json"]
        elif event["type"] == "content_block_stop" and event["index"] in json_text:
            blocks[event["index"]]["input"] = json.loads(json_text[event["index"]])
    return blocks


def test_blocks_open_when_the_kind_changes_and_accumulate_to_the_content():
    blocks = ContentBlocks()
    deltas = [
        ParsedDelta(reasoning="Let me "),
        ParsedDelta(reasoning="think."),
        ParsedDelta(reasoning=" Done.", content="Calling."),
        ParsedDelta(tool_calls=[ToolCallDelta(0, "call_a", "get_time", '{"zo')]),
        ParsedDelta(tool_calls=[ToolCallDelta(0, None, None, 'ne": "UTC"}')]),
        ParsedDelta(
            tool_calls=[
                ToolCallDelta(1, "call_b", "get_weather", ""),
                ToolCallDelta(1, arguments="{}"),
            ]
        ),
    ]
    events = [e for d in deltas for e in blocks.feed(d)] + blocks.close()
    kinds = [(e["type"], e["index"]) for e in events]
    assert kinds == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),  # the signature, before the thinking block's stop
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("content_block_start", 3),
        ("content_block_delta", 3),
        ("content_block_stop", 3),
    ]
    assert events[4]["delta"] == {"type": "signature_delta", "signature": ""}
    content = blocks.content()
    assert content[:2] == [
        {"type": "thinking", "thinking": "Let me think. Done.", "signature": ""},
        {"type": "text", "text": "Calling."},
    ]
    assert [(b["name"], b["input"]) for b in content[2:]] == [
        ("get_time", {"zone": "UTC"}),
        ("get_weather", {}),
    ]
    assert [b["id"] for b in content[2:]] == ["call_a", "call_b"]  # the parser's own ids
    assert _accumulate(events) == content
    assert blocks.num_tool_uses == 2


def test_a_call_the_parser_gave_no_id_gets_a_toolu_id():
    blocks = ContentBlocks()
    events = blocks.feed(ParsedDelta(tool_calls=[ToolCallDelta(0, None, "f", "{}")]))
    use_id = blocks.content()[0]["id"]
    assert use_id.startswith("toolu_") and len(use_id) == len("toolu_") + 24
    assert events[0]["content_block"]["id"] == use_id


def test_a_call_cut_short_has_an_empty_input_and_nothing_is_empty_without_text():
    blocks = ContentBlocks()
    blocks.feed(ParsedDelta(tool_calls=[ToolCallDelta(0, "c", "f", '{"a": [1, ')]))
    assert blocks.content()[0]["input"] == {}
    empty = ContentBlocks()
    assert empty.feed(ParsedDelta()) == [] and empty.close() == [] and empty.content() == []


# ---- the tracker: parsing, stop reasons, usage ------------------------------------------
def _job(num_prompt: int = 10) -> Job:
    return Job("msg_1", "m", [Prompt("p", list(range(num_prompt)))], [None], recorder=None)


def _output(text: str, tokens: int, finish=None, stop=None, cached: int = 0) -> RequestOutput:
    completion = CompletionOutput(
        0, text, list(range(tokens)), finish_reason=finish, stop_reason=stop
    )
    return RequestOutput(
        "msg_1-0", "p", [], [completion], finish is not None, num_cached_tokens=cached
    )


def _tracker(tools: bool = False, reasoning: bool = False) -> MessageTracker:
    parser = ReplyParser(
        get_reasoning_parser("qwen3").stream("") if reasoning else None,
        get_tool_parser("hermes")().stream() if tools else None,
    )
    return MessageTracker(_job(), parser)


@pytest.mark.parametrize(
    ("finish", "stop", "reason", "sequence"),
    [
        ("stop", None, "end_turn", None),  # EOS
        ("stop", 7, "end_turn", None),  # a stop token id
        ("stop", "END", "stop_sequence", "END"),
        ("length", None, "max_tokens", None),
        ("abort", None, "end_turn", None),
    ],
)
def test_stop_reasons(finish, stop, reason, sequence):
    tracker = _tracker()
    tracker.update(0, _output("Hello", 2))
    tracker.update(0, _output(" there", 1, finish, stop, cached=4))
    message = tracker.message()
    assert (message["stop_reason"], message["stop_sequence"]) == (reason, sequence)
    assert message["content"] == [{"type": "text", "text": "Hello there"}]
    assert message["usage"] == {
        "input_tokens": 6,
        "output_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
    }
    delta, stop_event = tracker.end_events()
    assert delta["delta"] == {"stop_reason": reason, "stop_sequence": sequence}
    assert stop_event == {"type": "message_stop"}


def test_thinking_and_a_tool_call_make_blocks_and_tool_use():
    tracker = _tracker(tools=True, reasoning=True)
    call = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    text = f"<think>plan</think>\n\n<tool_call>\n{call}\n</tool_call>"
    events = []
    for i in range(0, len(text), 5):  # cut anywhere, markers included
        piece = text[i : i + 5]
        events += tracker.update(0, _output(piece, 1, "stop" if i + 5 >= len(text) else None))
    message = tracker.message()
    assert message["stop_reason"] == "tool_use"
    kinds = [b["type"] for b in message["content"]]
    assert kinds[0] == "thinking" and kinds[-1] == "tool_use" and "thinking" not in kinds[1:]
    assert message["content"][0]["thinking"] == "plan"
    assert message["content"][-1]["input"] == {"zone": "UTC"}
    assert _accumulate(events) == message["content"]
    start = tracker.start_event()["message"]
    assert start["content"] == [] and start["stop_reason"] is None


def test_a_max_tokens_cut_after_a_call_is_max_tokens():
    tracker = _tracker(tools=True)
    tracker.update(
        0, _output('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', 9, "length")
    )
    assert tracker.stop_reason == "max_tokens"


# ---- the stream ---------------------------------------------------------------------------
async def _outputs(items, fail: Exception | None = None):
    for item in items:
        yield item
    if fail is not None:
        raise fail


def _parse(frames: list[str]) -> list[dict]:
    events = []
    for frame in frames:
        name, data = frame.rstrip("\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


async def _stream(tracker, first, rest) -> list[dict]:
    return _parse([frame async for frame in message_events(tracker, first, rest)])


def test_the_stream_starts_with_the_first_output_and_ends_with_message_stop():
    tracker = _tracker()
    first = (0, _output("", 0, cached=2))  # no text yet: message_start goes out anyway
    rest = _outputs([(0, _output("Hi", 1, "stop"))])
    events = asyncio.run(_stream(tracker, first, rest))
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"]["cache_read_input_tokens"] == 2
    assert events[-2]["usage"]["output_tokens"] == 1


def test_a_failure_mid_stream_ends_it_with_an_error_event():
    tracker = _tracker()
    rest = _outputs([(0, _output("Hi", 1))], fail=EngineUnavailableError("the engine went away"))
    events = asyncio.run(_stream(tracker, (0, _output("", 0)), rest))
    assert [e["type"] for e in events][-1] == "error"
    assert events[-1]["error"] == {"type": "overloaded_error", "message": "the engine went away"}
    assert "message_stop" not in [e["type"] for e in events]


# ---- errors and the key -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (
            InvalidRequestError("temperature must be at most 2", "temperature"),
            400,
            "invalid_request_error",
        ),
        (ValueError("bad"), 400, "invalid_request_error"),
        (
            RequestValidationError(
                [{"type": "missing", "loc": ("body", "max_tokens"), "msg": "Field required"}]
            ),
            400,
            "invalid_request_error",
        ),
        (AuthenticationError("no key"), 401, "authentication_error"),
        (ModelNotFoundError("nope"), 404, "not_found_error"),
        (RequestBodyTooLargeError(10), 413, "request_too_large"),
        (OverloadedError("busy"), 529, "overloaded_error"),
        (EngineOverloadedError("queue full"), 529, "overloaded_error"),
        (EngineUnavailableError("away"), 529, "overloaded_error"),
        (RuntimeError("boom"), 500, "api_error"),
    ],
)
def test_exceptions_map_to_anthropic_statuses_and_types(exc, status, kind):
    error = to_anthropic_error(exc)
    assert (error.status, error.type) == (status, kind)
    body = error.body()
    assert body == {"type": "error", "error": {"type": kind, "message": error.message}}
    assert error.message
    if isinstance(exc, RequestValidationError):
        assert error.message.startswith("max_tokens")


def test_internal_field_names_are_said_in_this_apis_terms():
    error = to_anthropic_error(LimitExceededError("stop has 9 stop strings, more than 8", "stop"))
    assert error.message == "stop_sequences has 9 stop strings, more than 8"
    stopping = to_anthropic_error(InvalidRequestError("stopping is fine"))
    assert stopping.message == "stopping is fine"


def test_x_api_key_is_the_bare_key_compared_whole():
    key = ApiKey("secret")
    assert key.allows_x_api_key("secret") and key.allows_x_api_key(b"secret")
    for wrong in (None, "", "Bearer secret", "secre", "secret2"):
        assert not key.allows_x_api_key(wrong)
    assert ApiKey(None).allows_x_api_key(None)
