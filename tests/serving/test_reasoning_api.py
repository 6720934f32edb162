"""A Qwen3-style thinking model over the OpenAI API (official client): the thinking comes
back apart from the answer, whole and streamed, exactly; Qwen3's own chat template with
enable_thinking from chat_template_kwargs; include_reasoning; a grammar applies to the
answer only; thinking_token_budget ends the thinking where the engine must.

The model is scripted (tests/helpers/scripted_model.py): after Qwen3's generation prompt
`<|im_start|>assistant\\n` it thinks and answers with THINKING_REPLY; after a closed, empty
think block (`</think>\\n\\n`, enable_thinking false) it answers PLAIN_REPLY.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import grpc
import jsonschema
import openai
import pytest

from services.common.proto.pagestream.v1 import generation_pb2, generation_pb2_grpc
from services.frontend.frontend_config import FrontendConfig
from services.frontend.frontend_server import serve_frontend
from services.frontend.tool_options import ToolServerOptions
from tests.helpers.openai_server import API_KEY, MODEL
from tests.helpers.scripted_model import build_scripted_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

QWEN3_TEMPLATE = (Path(__file__).parents[1] / "helpers" / "templates" / "qwen3.jinja").read_text()
QWEN_TOKENS = ("<|im_start|>", "<|im_end|>", "\n\n")
THINKING_REPLY = ["<think>", "\nThe user asks", " for 2+2.\n", "</think>", "\n\nIt is", " 4."]
PLAIN_REPLY = ["Just", " four."]
THOUGHT, ANSWER = "The user asks for 2+2.", "It is 4."
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}

SERVER_ARGS = {
    "frontend_config": FrontendConfig(reasoning_parser="qwen3"),
    "app_options": {
        "tool_options": ToolServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    },
    "kv_cache_memory": "32MiB",
}


@pytest.fixture(scope="module")
def server_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-scripted")
    return build_scripted_model(
        folder,
        {None: THINKING_REPLY, "\n\n": PLAIN_REPLY},
        chat_template=QWEN3_TEMPLATE,
        extra_tokens=QWEN_TOKENS,
    )


async def _chat(server, max_tokens: int = 40, **extra):
    client = server.async_client()
    return await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=max_tokens, **extra
    )


async def _stream(server, **extra) -> tuple[str, str, list]:
    """(thinking, answer, chunks) of a streamed reply."""
    client = server.async_client()
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40, stream=True, **extra
    )
    chunks = [chunk async for chunk in stream]
    thinking = answer = ""
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            thinking += (delta.model_extra or {}).get("reasoning_content") or ""
            answer += delta.content or ""
    return thinking, answer, chunks


async def test_the_thinking_comes_back_apart_from_the_answer(server):
    response = await _chat(server)
    message = response.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == THOUGHT
    assert message.model_extra["reasoning"] == THOUGHT  # vLLM's newer name
    assert response.choices[0].finish_reason == "stop"


async def test_streamed_deltas_split_the_same_way(server):
    thinking, answer, chunks = await _stream(server)
    assert (thinking, answer) == (THOUGHT, ANSWER)
    # thinking deltas come before any answer delta, and no delta mixes them
    kinds = []
    for chunk in chunks:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            has_thought, has_answer = (
                bool(extra.get("reasoning_content")),
                bool(choice.delta.content),
            )
            assert not (has_thought and has_answer)
            if has_thought or has_answer:
                kinds.append("thought" if has_thought else "answer")
    assert kinds == sorted(kinds, key=lambda k: k == "answer") and "answer" in kinds


async def test_enable_thinking_false_reaches_qwen3s_template(server):
    response = await _chat(server, extra_body=NO_THINKING)
    message = response.choices[0].message
    assert message.content == "Just four."
    assert message.model_extra["reasoning_content"] is None
    async with server.raw() as client:
        rendered = await client.post(
            "/tokenize", json={"messages": MESSAGES, "return_token_strs": True, **NO_THINKING}
        )
    assert rendered.status_code == 200, rendered.text


async def test_include_reasoning_false_drops_the_thinking(server):
    response = await _chat(server, extra_body={"include_reasoning": False})
    message = response.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] is None


async def test_reserved_template_kwargs_are_refused(server):
    with pytest.raises(openai.BadRequestError) as caught:
        await _chat(server, extra_body={"chat_template_kwargs": {"messages": []}})
    assert caught.value.body["param"] == "chat_template_kwargs"


async def test_a_thinking_budget_ends_the_thinking_in_the_engine(server):
    """Budget 1: one thought token, then the engine writes "\\n</think>\\n\\n" and the
    model, seeing a closed think block, answers PLAIN_REPLY."""
    response = await _chat(server, extra_body={"thinking_token_budget": 1})
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] == "The user asks"
    assert message.content == "Just four."


async def test_tool_choice_required_constrains_the_answer_only(server):
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    }
    response = await _chat(server, tools=[tool], tool_choice="required", max_tokens=200)
    choice = response.choices[0]
    assert choice.message.model_extra["reasoning_content"] == THOUGHT
    if choice.finish_reason == "length":  # the grammar lets a bigram model ramble in JSON
        pytest.fail(f"the constrained answer did not end: {choice.message}")
    (call,) = choice.message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


async def test_usage_counts_the_thinking_tokens(server):
    response = await _chat(server)
    # "<think>", "\nThe user asks", " for 2+2.\n": the deltas that were all thinking
    assert response.usage.completion_tokens_details.reasoning_tokens == 3
    assert response.usage.completion_tokens == len(THINKING_REPLY) + 1  # and EOS


async def test_responses_api_has_a_reasoning_item_before_the_message(server):
    client = server.async_client()
    response = await client.responses.create(model=MODEL, input="What is 2+2?", temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT
    assert message.type == "message" and response.output_text == ANSWER
    assert response.usage.output_tokens_details.reasoning_tokens == 3

    events = [
        e
        async for e in await client.responses.create(
            model=MODEL, input="What is 2+2?", temperature=0, stream=True
        )
    ]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == THOUGHT
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert [e.text for e in done] == [THOUGHT]
    completed = events[-1].response
    assert [item.type for item in completed.output] == ["reasoning", "message"]
    assert completed.output_text == ANSWER

    follow_up = await client.responses.create(
        model=MODEL,
        input=[*[item.model_dump() for item in response.output], {"role": "user", "content": "ok"}],
        temperature=0,
    )  # an agent sends the reasoning item back: accepted, left out of the prompt
    assert follow_up.status == "completed"


async def _grpc_generate(server, **chat_fields) -> tuple[str, str]:
    """(reasoning_text, text) of a greedy gRPC chat stream over the same engine."""
    budget = chat_fields.pop("thinking_token_budget", None)
    chat = generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(role="user", content="What is 2+2?")]
    )
    if "chat_template_kwargs" in chat_fields:
        chat.chat_template_kwargs.update(chat_fields["chat_template_kwargs"])
    params = generation_pb2.SamplingParams(temperature=0, max_tokens=40)
    if budget is not None:
        params.thinking_token_budget = budget
    handle = await serve_frontend(server.engine.frontend, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(chat=chat, sampling_params=params)
            responses = [r async for r in stub.Generate(request)]
    finally:
        await handle.stop(grace=None)
    return "".join(r.reasoning_text for r in responses), "".join(r.text for r in responses)


async def test_grpc_chat_carries_the_thinking_in_reasoning_text(server):
    assert await _grpc_generate(server) == (THOUGHT, ANSWER)
    no_thinking = await _grpc_generate(server, chat_template_kwargs={"enable_thinking": False})
    assert no_thinking == ("", "Just four.")
    assert await _grpc_generate(server, thinking_token_budget=1) == ("The user asks", "Just four.")


def _anthropic(server) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.http.url, api_key=API_KEY, max_retries=0)


async def test_anthropic_messages_carry_a_thinking_block_then_the_text(server):
    client = _anthropic(server)
    request = {"model": MODEL, "max_tokens": 40, "messages": MESSAGES}
    message = await client.messages.create(**request, extra_body={"temperature": 0})
    thinking, text = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", THOUGHT)
    assert (text.type, text.text) == ("text", ANSWER)
    assert message.stop_reason == "end_turn"

    async with client.messages.stream(**request, extra_body={"temperature": 0}) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    assert _blocks(final.content) == _blocks(message.content)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == THOUGHT
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]

    budget = {"type": "enabled", "budget_tokens": 1}  # the engine ends the thinking
    cut = await client.messages.create(**request, thinking=budget, extra_body={"temperature": 0})
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in cut.content] == [
        ("thinking", "The user asks"),
        ("text", "Just four."),
    ]
    off = await client.messages.create(
        **request, thinking={"type": "disabled"}, extra_body={"temperature": 0}
    )
    assert [(b.type, b.text) for b in off.content] == [("text", "Just four.")]


def _blocks(content) -> list[dict]:
    """Content blocks as plain dicts, without the ids each reply draws anew."""
    return [block.model_dump(exclude={"parsed_output", "citations", "id"}) for block in content]
