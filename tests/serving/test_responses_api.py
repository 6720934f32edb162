"""The Responses API (/v1/responses) with the official `openai` client over a tiny random
model: under greedy decoding its text is the chat completion's for the same conversation
(instructions, message lists, a previous_response_id chain, tool results); streaming
sends OpenAI's events in order and assembles to the non-streamed response; function
calls validate against their schema and continue with function_call_output; text.format
json_schema gives valid JSON; stored responses read back, store=false and unknown ids are
404s, the store stays within its bounds; bad requests are 400s naming the field."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from services.frontend.openai.response_store import ResponseStore
from services.frontend.tool_options import ToolServerOptions
from tests.helpers.eventually import eventually_async
from tests.helpers.openai_server import MODEL
from tests.helpers.tiny_models import build_tiny_model
from tests.helpers.tiny_tokenizer import VOCAB, build_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVER_ARGS = {
    "app_options": {
        "tool_options": ToolServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    },
    "kv_cache_memory": "32MiB",
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather forecast for a city.",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}
GREEDY = {"temperature": 0.0}
EVENTS = TypeAdapter(ResponseStreamEvent)  # the SDK's stream events, one union
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server_model(tmp_path_factory):
    """The tiny llama with room for a tools block (the tiny tokenizer spends ~1k tokens)."""
    folder = tmp_path_factory.mktemp("responses-llama")
    build_tiny_model("llama", vocab_size=VOCAB, max_position_embeddings=4096).save_pretrained(
        folder
    )
    build_tokenizer().save_pretrained(folder)
    return folder


async def _chat_text(client, messages, max_tokens: int, **kwargs) -> tuple[str, object]:
    chat = await client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=max_tokens, **GREEDY, **kwargs
    )
    return chat.choices[0].message.content, chat


def _check_against_chat(response, chat) -> None:
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    finished = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == finished


# ---- text, the same as chat completions ------------------------------------------------------
async def test_string_input_with_instructions_equals_chat(server):
    client = server.async_client()
    response = await client.responses.create(
        model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=12, **GREEDY
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    _, chat = await _chat_text(client, messages, 12)
    _check_against_chat(response, chat)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL and response.instructions == "Be brief."
    [message] = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert message.content[0].annotations == []
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0


async def test_what_agent_tooling_always_sends_changes_nothing(server):
    """Codex CLI and the Agents SDK send reasoning options, include values for reasoning
    items, truncation "auto" and store false to every model: accepted, the same text."""
    client = server.async_client()
    plain = await client.responses.create(
        model=MODEL, input="Hello there", max_output_tokens=10, **GREEDY
    )
    agent = await client.responses.create(
        model=MODEL,
        input="Hello there",
        max_output_tokens=10,
        reasoning={"effort": "low", "summary": "auto"},
        include=["reasoning.encrypted_content"],
        truncation="auto",
        store=False,
        parallel_tool_calls=False,
        text={"verbosity": "low"},
        **GREEDY,
    )
    assert agent.output_text == plain.output_text
    assert agent.usage.output_tokens == plain.usage.output_tokens


async def test_message_list_input_equals_chat(server):
    client = server.async_client()
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
        {"role": "user", "content": "How are you?"},
    ]
    response = await client.responses.create(
        model=MODEL, input=items, max_output_tokens=10, **GREEDY
    )
    messages = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "How are you?"},
    ]
    _, chat = await _chat_text(client, messages, 10)
    _check_against_chat(response, chat)


async def test_the_body_is_a_strict_openai_response(server):
    body = {
        "model": MODEL,
        "input": "Hi",
        "max_output_tokens": 6,
        "metadata": {"k": "v"},
        "user": "u1",
        **GREEDY,
    }
    async with server.raw() as raw:
        reply = await raw.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    response = Response.model_validate(data, strict=True)
    assert response.status in ("completed", "incomplete") and response.error is None
    assert response.metadata == {"k": "v"} and response.user == "u1" and response.store
    assert response.max_output_tokens == 6 and response.temperature == 0.0
    assert response.text.format.type == "text" and response.tool_choice == "none"
    assert response.tools == [] and response.parallel_tool_calls is True
    assert data["usage"]["input_tokens_details"]["cached_tokens"] >= 0
    assert data["previous_response_id"] is None and data["incomplete_details"] in (
        None,
        {"reason": "max_output_tokens"},
    )


async def test_a_small_max_output_tokens_is_incomplete(server):
    client = server.async_client()
    response = await client.responses.create(
        model=MODEL, input="Tell me a story", max_output_tokens=3, extra_body={"ignore_eos": True}
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


# ---- streaming ---------------------------------------------------------------------------------
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
TEXT_DONE = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


async def test_streamed_events_assemble_to_the_non_streamed_response(server):
    client = server.async_client()
    kwargs = dict(model=MODEL, input="Stream me", max_output_tokens=16, **GREEDY)
    whole = await client.responses.create(**kwargs)
    events = [event async for event in await client.responses.create(stream=True, **kwargs)]
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types[:4] == TEXT_EVENTS and deltas
    assert types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert types[4 + len(deltas) :] == [*TEXT_DONE, last]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(d.item_id == item_id and d.output_index == 0 for d in deltas)
    assert all(d.content_index == 0 and d.logprobs == [] for d in deltas)
    text = "".join(d.delta for d in deltas)
    assert text == events[4 + len(deltas)].text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert (await client.responses.retrieve(final.id)).output_text == text


async def test_the_sdk_stream_helper(server):
    """The helper's final response needs response.completed: a JSON reply ends."""
    client = server.async_client()
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER_PARAMETERS}
    kwargs = dict(model=MODEL, input="JSON", text={"format": fmt}, max_output_tokens=200)
    whole = await client.responses.create(**kwargs, **GREEDY)
    assert whole.status == "completed"
    async with client.responses.stream(**kwargs, **GREEDY) as stream:
        texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert final.output_text == "".join(texts) == whole.output_text
    assert final.id != whole.id and final.status == "completed"


SSE_BODIES = [
    {"input": "Hi", "max_output_tokens": 4},
    {"input": QUESTION, "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 800},
]


@pytest.mark.parametrize("fields", SSE_BODIES)
async def test_sse_frames_are_openai_s(server, fields):
    body = {"model": MODEL, "stream": True, **fields}
    async with server.raw() as raw:
        reply = await raw.post("/v1/responses", json=body)
    assert reply.headers["content-type"].startswith("text/event-stream")
    frames = reply.text.split("\n\n")
    assert frames[-1] == "" and "[DONE]" not in reply.text
    for frame in frames[:-1]:
        event, data = frame.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == event.removeprefix("event: ")
        EVENTS.validate_python(payload, strict=True)


ABORTED = 'pagestream:request_success_total{finished_reason="abort"}'


def _check_aborted(before: dict, samples: dict) -> None:
    assert samples['pagestream:kv_cache_usage_perc{engine="0"}'] == 0
    assert samples[ABORTED] == before.get(ABORTED, 0) + 1
    generated = samples["pagestream:generation_tokens_total"]
    assert generated - before["pagestream:generation_tokens_total"] < 2000


async def test_client_disconnect_mid_stream_aborts(server):
    before = await server.metrics()
    body = {
        "model": MODEL,
        "input": "Go on",
        "stream": True,
        "max_output_tokens": 2000,
        "ignore_eos": True,
    }
    async with server.raw() as raw, raw.stream("POST", "/v1/responses", json=body) as reply:
        deltas = 0
        async for line in reply.aiter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 3:
                break  # leaving the block closes the connection mid-stream
    _check_aborted(before, await server.wait_until_idle())
    # /metrics goes idle when the scheduler drops the request; a plan submitted before
    # the abort may still be in flight, and its output must drain, not linger
    engine = server.engine.engine
    await eventually_async(lambda: not engine.has_unfinished_requests(), "the engine drained")


async def test_client_disconnect_before_the_response_aborts(server):
    before = await server.metrics()
    body = {"model": MODEL, "input": "Go on", "max_output_tokens": 2000, "ignore_eos": True}
    frontend = server.engine.frontend
    await server.disconnect_while_running("/v1/responses", body)
    _check_aborted(before, await server.wait_until_idle())
    assert frontend.num_live_requests() == 0


async def test_an_engine_failure_mid_stream_ends_with_response_failed(server, monkeypatch):
    frontend = server.engine.frontend
    generate = frontend.generate

    async def failing(*args, **kwargs):
        async with contextlib.aclosing(generate(*args, **kwargs)) as outputs:
            async for output in outputs:
                yield output
                raise RuntimeError("the engine broke")

    monkeypatch.setattr(frontend, "generate", failing)
    client = server.async_client()
    stream = await client.responses.create(
        model=MODEL, input="Hi", stream=True, max_output_tokens=50, extra_body={"ignore_eos": True}
    )
    events = [event async for event in stream]
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed"
    error = events[-1].response.error
    assert error.code == "server_error" and "RuntimeError" in error.message
    monkeypatch.undo()
    await server.wait_until_idle()


# ---- function calls ----------------------------------------------------------------------------
def _calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


async def test_a_function_call_round_trip(server):
    client = server.async_client()
    first = await client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=800,
    )
    [call] = _calls(first)
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert first.tools[0].name == "get_weather" and first.tool_choice == "required"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"t": 21}'}
    second = await client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
        **GREEDY,
    )
    assert second.previous_response_id == first.id and _calls(second) == []
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
        ],
    }
    messages = [
        {"role": "user", "content": QUESTION},
        assistant,
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"t": 21}'},
    ]
    _, chat = await _chat_text(client, messages, 8, tools=[CHAT_WEATHER], tool_choice="none")
    _check_against_chat(second, chat)
    async with server.raw() as raw:
        tokens = await raw.post("/tokenize", json={"messages": messages, "tools": [CHAT_WEATHER]})
    prompt = server.engine.tokenizer.decode(tokens.json()["tokens"])
    assert '<tool_response>\n{"t": 21}\n</tool_response>' in prompt


async def test_function_call_items_in_the_input_equal_chat_tool_calls(server):
    client = server.async_client()
    items = [
        {"role": "user", "content": QUESTION},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Rome", "days": 2}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    response = await client.responses.create(
        model=MODEL, input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=8, **GREEDY
    )
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    _, chat = await _chat_text(client, messages, 8, tools=[CHAT_WEATHER], tool_choice="none")
    _check_against_chat(response, chat)


async def test_auto_tool_choice_equals_chat(server):
    client = server.async_client()
    response = await client.responses.create(
        model=MODEL, input=QUESTION, tools=[WEATHER], max_output_tokens=8, **GREEDY
    )
    messages = [{"role": "user", "content": QUESTION}]
    _, chat = await _chat_text(client, messages, 8, tools=[CHAT_WEATHER])
    _check_against_chat(response, chat)
    assert response.tool_choice == "auto"


async def test_a_streamed_function_call(server):
    client = server.async_client()
    kwargs = dict(
        model=MODEL,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=800,
        extra_body={"seed": 3},
    )
    whole = await client.responses.create(**kwargs)
    stream = await client.responses.create(stream=True, **kwargs)
    events = [event async for event in stream]
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    assert types[3 : 3 + len(deltas)] == ["response.function_call_arguments.delta"] * len(deltas)
    assert types[3 + len(deltas) :] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[3 + len(deltas)]
    assert "".join(deltas) == done.arguments == events[-1].response.output[0].arguments
    assert done.arguments == _calls(whole)[0].arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER_PARAMETERS)
    async with client.responses.stream(**kwargs) as helper:
        final = await helper.get_final_response()
    assert _calls(final)[0].arguments == done.arguments


# ---- structured outputs -------------------------------------------------------------------------
async def test_text_format_json_schema_gives_valid_json(server):
    client = server.async_client()
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER_PARAMETERS, "strict": True}
    for seed in range(3):
        response = await client.responses.create(
            model=MODEL,
            input="Weather as JSON please.",
            text={"format": fmt},
            max_output_tokens=200,
            extra_body={"seed": seed},
        )
        assert response.status == "completed", response
        jsonschema.validate(json.loads(response.output_text), WEATHER_PARAMETERS)
        assert response.text.format.type == "json_schema" and response.text.format.name == "weather"
    json_object = await client.responses.create(
        model=MODEL, input="JSON", text={"format": {"type": "json_object"}}, max_output_tokens=200
    )
    if json_object.status == "completed":
        assert isinstance(json.loads(json_object.output_text), dict)


# ---- state: previous_response_id, GET, store ----------------------------------------------------
async def test_previous_response_id_continues_the_conversation(server):
    client = server.async_client()
    first = await client.responses.create(
        model=MODEL, input="Hi", instructions="Old rules.", max_output_tokens=6, **GREEDY
    )
    second = await client.responses.create(
        model=MODEL,
        input="And then?",
        instructions="New rules.",
        previous_response_id=first.id,
        max_output_tokens=6,
        **GREEDY,
    )
    messages = [
        {"role": "system", "content": "New rules."},  # the first one's are not carried over
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    _, chat = await _chat_text(client, messages, 6)
    _check_against_chat(second, chat)
    third = await client.responses.create(
        model=MODEL, input="Last.", previous_response_id=second.id, max_output_tokens=6, **GREEDY
    )
    messages = [*messages[1:], {"role": "assistant", "content": second.output_text}]
    _, chat = await _chat_text(client, [*messages, {"role": "user", "content": "Last."}], 6)
    _check_against_chat(third, chat)
    stored = await client.responses.retrieve(first.id)
    assert stored.model_dump() == first.model_dump()


async def test_store_false_and_unknown_ids_are_404(server, caplog):
    client = server.async_client()
    response = await client.responses.create(
        model=MODEL, input="Hi", store=False, max_output_tokens=2
    )
    assert response.store is False
    with pytest.raises(openai.NotFoundError) as error:
        await client.responses.retrieve(response.id)
    assert error.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as error:
        await client.responses.create(
            model=MODEL, input="Hi", previous_response_id="resp_nope", max_output_tokens=2
        )
    assert error.value.body["param"] == "previous_response_id"
    assert error.value.body["message"] == "Previous response with id 'resp_nope' not found."
    assert error.value.body["type"] == "invalid_request_error"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # handled, not raised


async def test_input_items_list_a_responses_own_input(server):
    client = server.async_client()
    first = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    items = [
        {"role": "user", "content": "One"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Two"}],
        },
        {"role": "user", "content": [{"type": "input_text", "text": "Three"}], "id": "msg_mine"},
    ]
    second = await client.responses.create(
        model=MODEL, input=items, previous_response_id=first.id, max_output_tokens=2
    )
    page = await client.responses.input_items.list(second.id, order="asc")
    texts = [item.content[0].text for item in page.data]
    assert texts == ["One", "Two", "Three"]  # its own input, not the chain's
    assert [item.role for item in page.data] == ["user", "assistant", "user"]
    assert page.data[2].id == "msg_mine" and all(item.id for item in page.data)
    newest = await client.responses.input_items.list(second.id, limit=2)  # desc by default
    assert [item.content[0].text for item in newest.data] == ["Three", "Two"]
    assert newest.has_more
    rest = await client.responses.input_items.list(second.id, after=newest.data[-1].id)
    assert [item.content[0].text for item in rest.data] == ["One"] and not rest.has_more
    [only] = (await client.responses.input_items.list(first.id)).data
    assert only.type == "message" and only.content[0].type == "input_text"
    with pytest.raises(openai.NotFoundError):
        await client.responses.input_items.list("resp_nope")


async def test_delete_forgets_a_response(server):
    client = server.async_client()
    response = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    await client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(response.id)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_the_store_stays_bounded_under_many_requests(server):
    serving = server.app.state.responses
    clock = _Clock()
    original, serving.store = serving.store, ResponseStore(5, max_age_s=100.0, clock=clock)
    try:
        client = server.async_client()
        ids = []
        for i in range(50):
            response = await client.responses.create(
                model=MODEL, input=f"Request {i}", max_output_tokens=1
            )
            ids.append(response.id)
            assert len(serving.store) <= 5
        for old in ids[:-5]:
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(old)
        for kept in ids[-5:]:
            assert (await client.responses.retrieve(kept)).id == kept
        clock.now = 101.0  # every entry is now older than max_age_s
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(ids[-1])
        assert len(serving.store) == 0
        serving.store = ResponseStore(0)  # 0: store none
        response = await client.responses.create(model=MODEL, input="x", max_output_tokens=1)
        assert response.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response.id)
    finally:
        serving.store = original


async def test_concurrent_chains_keep_their_own_conversations(server):
    client = server.async_client()
    roots = await asyncio.gather(
        *(
            client.responses.create(model=MODEL, input=f"Chain {i}", max_output_tokens=4, **GREEDY)
            for i in range(4)
        )
    )
    follow_ups = await asyncio.gather(
        *(
            client.responses.create(
                model=MODEL, input="Next", previous_response_id=r.id, max_output_tokens=4, **GREEDY
            )
            for r in roots
        )
    )
    for i, (root, follow_up) in enumerate(zip(roots, follow_ups, strict=True)):
        messages = [
            {"role": "user", "content": f"Chain {i}"},
            {"role": "assistant", "content": root.output_text},
            {"role": "user", "content": "Next"},
        ]
        _, chat = await _chat_text(client, messages, 4)
        _check_against_chat(follow_up, chat)


# ---- bad requests --------------------------------------------------------------------------------
BAD = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "input[0].content[0].image_url",
    ),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
        "input[0].arguments",
    ),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"max_output_tokens": 4095}, "max_output_tokens"),
    (
        {
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {"type": "array", "uniqueItems": True},
                }
            }
        },
        "text.format",
    ),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    (
        {
            "tools": [WEATHER],
            "tool_choice": "required",
            "text": {"format": {"type": "json_object"}},
        },
        "tool_choice",
    ),
    ({"background": True}, "background"),
    ({"include": ["everything"]}, "include"),
    ({"truncation": "middle"}, "truncation"),
    ({"max_tool_calls": 0}, "max_tool_calls"),
    ({"metadata": {"k": "v" * 600}}, "metadata"),
    ({"temperature": -1}, "temperature"),
    ({"top_logprobs": 99}, "top_logprobs"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
async def test_bad_requests_are_400_naming_the_field(server, fields, param):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **fields}
    async with server.raw() as raw:
        reply = await raw.post("/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


async def test_bad_requests_are_bad_request_errors_in_the_sdk(server):
    client = server.async_client()
    with pytest.raises(openai.BadRequestError) as error:
        await client.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}])
    assert "function tools only" in error.value.message
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="no-such-model", input="Hi")


async def test_logprobs_come_with_the_text(server):
    client = server.async_client()
    response = await client.responses.create(
        model=MODEL, input="Hi", top_logprobs=2, max_output_tokens=4, **GREEDY
    )
    part = response.output[0].content[0]
    assert len(part.logprobs) == response.usage.output_tokens
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
