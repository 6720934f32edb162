"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) driven by the
official `anthropic` client against a real server over the in-process engine (the tiny
llama with the hermes tool parser and auto tool choice): replies equal the chat
completion of the same conversation, streams accumulate to the non-streamed message,
tool_use / tool_result round trips, tool_choice any / tool constrained to valid calls,
stop sequences and max_tokens, count_tokens against /tokenize, and errors in Anthropic's
shape with the client's exception classes (auth by x-api-key or Bearer)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import anthropic
import jsonschema
import pytest

from services.frontend.tool_options import ToolServerOptions
from tests.helpers.openai_server import API_KEY, MODEL, TIMEOUT, running_server
from tests.helpers.scripted_model import build_scripted_model
from tests.helpers.tiny_models import build_tiny_model
from tests.helpers.tiny_tokenizer import VOCAB, build_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVER_ARGS = {
    "api_key": API_KEY,
    "app_options": {
        "tool_options": ToolServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    },
    "kv_cache_memory": "32MiB",
}
WEATHER = {
    "name": "get_weather",
    "description": "The weather forecast for a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 6}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
SYSTEM = "You are terse."
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# The client (2.x) has no sampling arguments; the API's temperature goes in the body.
GREEDY = {"model": MODEL, "max_tokens": 12, "extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server_model(tmp_path_factory):
    """The tiny llama with room for a tools block (the tiny tokenizer spends ~1k tokens)."""
    folder = tmp_path_factory.mktemp("anthropic-llama")
    build_tiny_model("llama", vocab_size=VOCAB, max_position_embeddings=4096).save_pretrained(
        folder
    )
    build_tokenizer().save_pretrained(folder)
    return folder


def _client(server, **auth) -> anthropic.AsyncAnthropic:
    auth = auth or {"api_key": API_KEY}
    return anthropic.AsyncAnthropic(
        base_url=server.http.url, max_retries=0, timeout=TIMEOUT, **auth
    )


def _comparable(message) -> dict:
    """A message without its random ids (the message's and its tool_use blocks'), its
    prompt tokens counted together (a repeated prompt is read from the prefix cache)."""
    body = message.model_dump(exclude_none=True)
    del body["id"]
    usage = body["usage"]
    usage["input_tokens"] += usage.pop("cache_read_input_tokens")
    for block in body["content"]:
        block.pop("id", None)
    return body


async def test_reply_equals_the_chat_completion(server):
    system = [{"type": "text", "text": SYSTEM}]
    message = await _client(server).messages.create(system=system, messages=MESSAGES, **GREEDY)
    chat = await server.async_client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *MESSAGES],
        temperature=0,
        max_tokens=GREEDY["max_tokens"],
    )
    choice = chat.choices[0]
    assert message.id.startswith("msg_") and message.type == "message"
    assert (message.role, message.model) == ("assistant", MODEL)
    assert "".join(b.text for b in message.content if b.type == "text") == choice.message.content
    reasons = {"length": "max_tokens", "stop": "end_turn"}
    assert message.stop_reason == reasons[choice.finish_reason]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.cache_creation_input_tokens == 0


async def test_system_string_and_blocks_are_the_same_prompt(server):
    client = _client(server)
    as_text = await client.messages.create(system=SYSTEM, messages=MESSAGES, **GREEDY)
    blocks = [{"type": "text", "text": SYSTEM}]
    as_blocks = await client.messages.create(system=blocks, messages=MESSAGES, **GREEDY)
    assert _comparable(as_text) == _comparable(as_blocks)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
        {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}},
    ],
)
async def test_stream_accumulates_to_the_non_streamed_message(server, extra):
    client = _client(server)
    kwargs = {**GREEDY, "max_tokens": 800, "system": SYSTEM, "messages": MESSAGES, **extra}
    whole = await client.messages.create(**kwargs)
    async with client.messages.stream(**kwargs) as stream:
        streamed = await stream.get_final_message()
    assert _comparable(streamed) == _comparable(whole)
    if extra:
        assert whole.stop_reason == "tool_use"


async def _raw_events(server, body: dict) -> list[dict]:
    """The SSE events of a streamed request, each `event:` line checked against its data's
    type (the client hides pings, so the stream is read raw)."""
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    async with server.raw(api_key=None) as raw:
        response = await raw.post("/v1/messages", json={**body, "stream": True}, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for frame in response.text.split("\n\n"):
        if not frame:
            continue
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


async def test_stream_events_come_in_anthropics_order(server):
    body = {
        **GREEDY,
        "tools": TOOLS,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": MESSAGES,
        "max_tokens": 800,
        **GREEDY["extra_body"],
    }
    del body["extra_body"]
    events = await _raw_events(server, body)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 0
    open_index, next_index, partial = None, 0, {}
    for event in events[2:-2]:
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == next_index
            open_index, next_index = event["index"], next_index + 1
            block = event["content_block"]
            if block["type"] == "tool_use":
                assert block["id"].startswith("call_") and block["input"] == {}  # hermes's
                partial[event["index"]] = (block["name"], "")
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
            if event["delta"]["type"] == "input_json_delta":
                name, text = partial[event["index"]]
                partial[event["index"]] = (name, text + event["delta"]["partial_json"])
        else:
            assert event["type"] == "content_block_stop" and event["index"] == open_index
            open_index = None
    assert open_index is None and len(partial) == 1
    for name, text in partial.values():
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] > 0


async def test_tool_choice_any_and_tool_give_valid_tool_use(server):
    client = _client(server)
    cases = (  # (tool_choice, the names it allows, whether several calls may come)
        ({"type": "any"}, set(SCHEMAS), True),
        ({"type": "any", "disable_parallel_tool_use": True}, set(SCHEMAS), False),
        ({"type": "tool", "name": "get_time"}, {"get_time"}, False),
    )
    for choice, names, parallel in cases:
        message = await client.messages.create(
            tools=TOOLS, tool_choice=choice, messages=MESSAGES, **{**GREEDY, "max_tokens": 800}
        )
        assert message.stop_reason == "tool_use"
        uses = [b for b in message.content if b.type == "tool_use"]
        assert len(uses) >= 1 if parallel else len(uses) == 1
        assert all(b.type in ("text", "tool_use") for b in message.content)
        for use in uses:
            assert use.id.startswith("call_") and use.name in names
            jsonschema.validate(use.input, SCHEMAS[use.name])


async def test_tool_use_and_tool_result_round_trip(server):
    client = _client(server)
    first = await client.messages.create(
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=MESSAGES,
        **{**GREEDY, "max_tokens": 800},
    )
    use = next(b for b in first.content if b.type == "tool_use")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": '{"forecast": "sunny"}'}
    conversation = [
        *MESSAGES,
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [result, {"type": "text", "text": "Thanks."}]},
    ]
    second = await client.messages.create(
        tools=TOOLS, tool_choice={"type": "none"}, messages=conversation, **GREEDY
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in second.content)
    # the conversation the template saw: the call, its result, then the user's text
    openai_messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": json.dumps(use.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": '{"forecast": "sunny"}'},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
    ]
    count = await client.messages.count_tokens(model=MODEL, messages=conversation)
    async with server.raw() as raw:
        response = await raw.post("/tokenize", json={"model": MODEL, "messages": openai_messages})
    tokens = response.json()["tokens"]
    assert count.input_tokens == len(tokens)
    prompt = server.engine.tokenizer.decode(tokens)
    assert '<tool_response>\n{"forecast": "sunny"}\n</tool_response>' in prompt
    assert '"name": "get_weather"' in prompt


# Mistral's templates refuse a call id that is not 9 alphanumerics; this one does the same.
NINE_CHAR_IDS_TEMPLATE = """
{%- macro check(id) -%}
{%- if id is not string or id | length != 9 or not id.isalnum() -%}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") -}}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}
{%- for message in messages -%}
{%- if message.role == "tool" -%}
{{- check(message.tool_call_id) }}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- elif message.tool_calls -%}
{%- for call in message.tool_calls %}{{ check(call.id) }}{% endfor -%}
[TOOL_CALLS]{{ message.tool_calls | tojson }}</s>
{%- else -%}
[{{ message.role }}]{{ message.content }}
{%- endif -%}
{%- endfor -%}
"""


async def test_mistral_call_ids_come_back_through_its_template(tmp_path):
    """A tool_use block's id is the parser's (mistral's 9 alphanumerics), so the next turn
    sends back ids the model's template accepts; another id passes through unchanged and
    the template's refusal is a 400."""
    reply = ["[TOOL_CALLS]", '[{"name": "get_time", "arguments": {"zone": "UTC"}}]']
    folder = build_scripted_model(tmp_path, {None: reply}, chat_template=NINE_CHAR_IDS_TEMPLATE)
    options = ToolServerOptions(enable_auto_tool_choice=True, tool_call_parser="mistral")
    async with running_server(folder, app_options={"tool_options": options}) as served:
        client = _client(served)
        request = {**GREEDY, "max_tokens": 60, "tools": [TIME]}
        first = await client.messages.create(messages=MESSAGES, **request)
        assert first.stop_reason == "tool_use"
        (use,) = first.content
        assert (use.name, use.input) == ("get_time", {"zone": "UTC"})
        assert len(use.id) == 9 and use.id.isalnum()

        def conversation(use_id: str) -> list[dict]:
            result = {"type": "tool_result", "tool_use_id": use_id, "content": "12:00"}
            return [
                *MESSAGES,
                {"role": "assistant", "content": [{**use.model_dump(), "id": use_id}]},
                {"role": "user", "content": [result, {"type": "text", "text": "Thanks."}]},
            ]

        second = await client.messages.create(
            messages=conversation(use.id), tool_choice={"type": "none"}, **request
        )
        assert second.type == "message" and second.usage.input_tokens > 0
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(messages=conversation("toolu_01AbC"), **request)
        _check_error(info, anthropic.BadRequestError, "invalid_request_error", "length 9")


# Llama 2's and Mistral's templates refuse a conversation whose turns do not alternate.
ALTERNATING_TEMPLATE = """
{%- for message in messages -%}
{%- if (message.role == "user") != loop.index0 is even -%}
{{- raise_exception("Conversation roles must alternate user/assistant/user/assistant") -}}
{%- endif -%}
[{{ message.role }}]{{ message.content }}
{%- endfor -%}
"""


async def test_consecutive_user_turns_are_one_turn_and_prefill_is_refused(tmp_path):
    folder = build_scripted_model(tmp_path, {None: ["Sure."]}, chat_template=ALTERNATING_TEMPLATE)
    async with running_server(folder) as served:
        client = _client(served)
        messages = [
            {"role": "user", "content": "one"},
            {"role": "user", "content": [{"type": "text", "text": "two"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "three"},
        ]
        message = await client.messages.create(messages=messages, **GREEDY)
        assert [b.text for b in message.content] == ["Sure."]
        count = await client.messages.count_tokens(model=MODEL, messages=messages)
        merged = [
            {"role": "user", "content": "one\n\ntwo"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "three"},
        ]
        async with served.raw() as raw:
            response = await raw.post("/tokenize", json={"model": MODEL, "messages": merged})
        assert count.input_tokens == response.json()["count"]
        assert (
            message.usage.input_tokens + message.usage.cache_read_input_tokens == count.input_tokens
        )
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(
                messages=[*messages, {"role": "assistant", "content": "{"}], **GREEDY
            )
        _check_error(
            info, anthropic.BadRequestError, "invalid_request_error", "messages[4]", "prefilling"
        )


async def test_count_tokens_equals_tokenize(server):
    count = await _client(server).messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=MESSAGES
    )
    openai_messages = [{"role": "system", "content": SYSTEM}, *MESSAGES]
    async with server.raw() as raw:
        response = await raw.post("/tokenize", json={"model": MODEL, "messages": openai_messages})
    assert count.input_tokens == response.json()["count"] > 0
    with_tools = await _client(server).messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=MESSAGES, tools=TOOLS
    )
    assert with_tools.input_tokens > count.input_tokens  # the tools are in the prompt


async def test_count_tokens_of_a_conversation_longer_than_the_context(server):
    """Counting generates nothing: a conversation past max_model_len is counted (the client
    learns it must compact), while creating a message from it is refused."""
    max_model_len = server.engine.frontend.info.max_model_len
    long_messages = [{"role": "user", "content": "word " * max_model_len}]
    client = _client(server)
    count = await client.messages.count_tokens(model=MODEL, messages=long_messages)
    async with server.raw() as raw:
        response = await raw.post("/tokenize", json={"model": MODEL, "messages": long_messages})
    assert count.input_tokens == response.json()["count"] > max_model_len
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(messages=long_messages, **GREEDY)
    _check_error(info, anthropic.BadRequestError, "invalid_request_error", "context length")


async def test_stop_sequences_and_max_tokens(server):
    client = _client(server)
    free = await client.messages.create(messages=MESSAGES, **{**GREEDY, "max_tokens": 16})
    assert free.stop_reason == "max_tokens" and free.usage.output_tokens == 16
    text = free.content[0].text
    # a letter or digit the reply writes first past its start (the tiny model writes bytes)
    stops = [c for c in text if c.isascii() and c.isalnum() and text.index(c) > 0]
    assert stops, text
    stop = stops[len(stops) // 2]
    stopped = await client.messages.create(
        messages=MESSAGES, stop_sequences=["never seen", stop], **{**GREEDY, "max_tokens": 16}
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[: text.index(stop)]
    async with client.messages.stream(
        messages=MESSAGES, stop_sequences=[stop], **{**GREEDY, "max_tokens": 16}
    ) as stream:
        streamed = await stream.get_final_message()
    assert _comparable(streamed) == _comparable(stopped)


def _check_error(exc_info, cls, kind: str, *words: str) -> None:
    error = exc_info.value
    assert isinstance(error, cls), error
    body = error.body
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    for word in words:
        assert word in body["error"]["message"], body


async def test_errors_are_anthropic_shaped(server):
    client = _client(server)
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=None)
    _check_error(info, anthropic.BadRequestError, "invalid_request_error", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(messages=[{"role": "system", "content": "hi"}], **GREEDY)
    _check_error(info, anthropic.BadRequestError, "invalid_request_error", "messages[0].role")
    with pytest.raises(anthropic.NotFoundError) as info:
        await client.messages.create(**{**GREEDY, "model": "nope"}, messages=MESSAGES)
    _check_error(info, anthropic.NotFoundError, "not_found_error", "nope")
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    content = [{"type": "text", "text": "What is this?"}, image]
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(messages=[{"role": "user", "content": content}], **GREEDY)
    _check_error(
        info, anthropic.BadRequestError, "invalid_request_error", "messages[0].content[1]", "images"
    )
    server_tool = {"type": "web_search_20250305", "name": "web_search"}
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(messages=MESSAGES, tools=[server_tool], **GREEDY)
    _check_error(info, anthropic.BadRequestError, "invalid_request_error", "tools[0]")
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(messages=MESSAGES, stop_sequences=["x"] * 1000, **GREEDY)
    _check_error(info, anthropic.BadRequestError, "invalid_request_error", "stop_sequences")
    assert (await client.messages.create(messages=MESSAGES, **GREEDY)).content is not None


async def test_thinking_on_a_model_without_a_reasoning_parser_is_just_answered(server):
    """Agent clients ask every model to think: without --reasoning-parser the request is
    answered as if it had not asked (no thinking blocks, no budget), not refused."""
    client = _client(server)
    off = await client.messages.create(messages=MESSAGES, thinking={"type": "disabled"}, **GREEDY)
    assert all(b.type == "text" for b in off.content)  # this server has no reasoning parser
    on = await client.messages.create(
        messages=MESSAGES, thinking={"type": "enabled", "budget_tokens": 4}, **GREEDY
    )
    assert all(b.type == "text" for b in on.content)
    assert on.content == off.content  # the tiny template ignores enable_thinking
    with pytest.raises(anthropic.BadRequestError) as info:  # Anthropic's own rule still holds
        await client.messages.create(
            messages=MESSAGES, thinking={"type": "enabled", "budget_tokens": 10**6}, **GREEDY
        )
    _check_error(info, anthropic.BadRequestError, "invalid_request_error", "thinking.budget_tokens")
    count = await client.messages.count_tokens(
        model=MODEL, messages=MESSAGES, thinking={"type": "enabled", "budget_tokens": 4}
    )
    assert count.input_tokens > 0  # the budget shapes the output only


async def test_api_key_by_x_api_key_or_bearer(server):
    for auth in ({"api_key": "wrong"}, {"auth_token": "wrong"}):
        with pytest.raises(anthropic.AuthenticationError) as info:
            await _client(server, **auth).messages.create(messages=MESSAGES, **GREEDY)
        _check_error(info, anthropic.AuthenticationError, "authentication_error", "x-api-key")
    by_bearer = await _client(server, auth_token=API_KEY).messages.create(
        messages=MESSAGES, **GREEDY
    )
    assert by_bearer.type == "message"
    async with server.raw(api_key=None) as raw:
        response = await raw.post(
            "/v1/messages/count_tokens", json={"model": MODEL, "messages": MESSAGES}
        )
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


async def test_raw_bodies_malformed_and_too_large(server):
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    async with server.raw(api_key=None) as raw:
        malformed = await raw.post("/v1/messages", content=b"{", headers=headers)
        limit = server.engine.frontend.config.max_request_body_bytes
        huge = await raw.post("/v1/messages", content=b" " * (limit + 1), headers=headers)
        openai_huge = await raw.post(
            "/v1/chat/completions",
            content=b" " * (limit + 1),
            headers={"authorization": f"Bearer {API_KEY}"},
        )
    assert malformed.status_code == 400
    assert malformed.json()["error"]["type"] == "invalid_request_error"
    assert huge.status_code == 413
    assert huge.json() == {
        "type": "error",
        "error": {"type": "request_too_large", "message": huge.json()["error"]["message"]},
    }
    assert openai_huge.status_code == 400 and "error" in openai_huge.json()  # OpenAI's shape stays


async def test_client_that_goes_away_aborts_its_request(server):
    body = {"model": MODEL, "max_tokens": 2000, "messages": MESSAGES, "stream": True}
    await server.disconnect_while_running("/v1/messages", body)
    await server.wait_until_idle()


async def test_overload_is_529_overloaded_error(model_dir):
    """The chat endpoint's 429 (too many requests waiting) is Anthropic's 529 here, which
    its clients retry; admitted requests complete, streamed or not."""
    overload = {"max_num_seqs": 1, "max_waiting_requests": 1}
    async with running_server(model_dir("llama"), **overload) as served:
        headers = {"x-api-key": API_KEY}
        body = {"model": MODEL, "max_tokens": 24, "messages": MESSAGES, "temperature": 0}

        async def post(i: int):
            async with served.raw(api_key=None) as raw:
                stream = {"stream": i % 2 == 1}
                return await raw.post("/v1/messages", json=body | stream, headers=headers)

        responses = await asyncio.gather(*(post(i) for i in range(12)))
        statuses = Counter(r.status_code for r in responses)
        assert set(statuses) == {200, 529}, statuses
        for response in responses:
            if response.status_code == 529:
                assert response.headers["retry-after"] == "1"
                error = response.json()
                assert error["type"] == "error"
                assert error["error"]["type"] == "overloaded_error"
                assert "max_waiting_requests=1" in error["error"]["message"]
            elif response.headers["content-type"].startswith("text/event-stream"):
                assert response.text.rstrip().endswith('data: {"type": "message_stop"}')
            else:
                assert response.json()["type"] == "message"
