"""ResponseOutputBuilder: chat deltas become output items and the events that build them,
in OpenAI's order (a message's part and text, then each function call's arguments)."""

from __future__ import annotations

from services.frontend.openai.replies import (
    ChatLogprobEntry,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)
from services.frontend.openai.response_output_builder import ResponseOutputBuilder


def _call(index: int, arguments: str, call_id: str | None = None, name: str | None = None):
    function = DeltaFunctionCall(name=name, arguments=arguments)
    return DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=call_id, function=function)])


def test_text_then_two_calls():
    builder = ResponseOutputBuilder()
    events = builder.feed(DeltaMessage(content="Let me "), None)
    events += builder.feed(DeltaMessage(content="check."), None)
    events += builder.feed(_call(0, '{"a":', "call_0", "f"), None)
    events += builder.feed(_call(0, " 1}"), None)
    events += builder.feed(_call(1, "{}", "call_1", "g"), None)
    events += builder.finish("completed")
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    message, first, second = builder.items
    assert message.content[0].text == "Let me check." and message.status == "completed"
    assert (first.call_id, first.name, first.arguments) == ("call_0", "f", '{"a": 1}')
    assert (second.call_id, second.name, second.arguments) == ("call_1", "g", "{}")
    assert [e["output_index"] for e in events if "output_index" in e][-4:] == [2, 2, 2, 2]
    added = events[0]["item"]
    assert added["content"] == [] and added["status"] == "in_progress"
    assert events[7]["item"]["arguments"] == "" and events[11]["item"]["arguments"] == '{"a": 1}'


def test_an_empty_reply_is_one_empty_message():
    builder = ResponseOutputBuilder()
    events = builder.finish("incomplete")
    assert [e["type"] for e in events][-1] == "response.output_item.done"
    [message] = builder.items
    assert message.content[0].text == "" and message.status == "incomplete"


def test_logprobs_go_with_the_text_they_came_with():
    builder = ResponseOutputBuilder()
    entry = ChatLogprobEntry(token="a", logprob=-0.5, bytes=[97])
    held = ChatLogprobEntry(token="b", logprob=-1.0, bytes=[98])
    events = builder.feed(DeltaMessage(content="a"), [entry])
    events += builder.feed(DeltaMessage(), [held])  # text held back (a stop string)
    events += builder.finish("completed")
    assert events[2]["logprobs"] == [entry.model_dump()]
    assert events[3]["type"] == "response.output_text.done" and len(events[3]["logprobs"]) == 2
    assert builder.items[0].content[0].logprobs == [entry, held]
