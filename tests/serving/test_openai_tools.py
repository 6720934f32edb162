"""Tool calling over the OpenAI API with the official `openai` client (tiny random model):
tool_choice "required" and a named function give well-formed tool_calls whose arguments
validate against the tool's parameters; streamed deltas assemble to the non-streamed
result; a follow-up with `tool` messages works; "auto" needs the server flags; bad tool
requests are 400s; the tool-aware ChatML template stands in for one that ignores tools."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagestream.cli import build_parser
from pagestream.roles import tool_options
from pagestream.split_layout import frontend_flags
from services.frontend.chat_templates import shipped_template
from services.frontend.openai.chat_messages import ChatMessage
from services.frontend.openai.chat_rendering import render_chat
from services.frontend.openai.serving_chat import _tools_template
from services.frontend.tool_options import ToolServerOptions
from tests.helpers.openai_server import MODEL, running_server
from tests.helpers.tiny_models import build_tiny_model
from tests.helpers.tiny_tokenizer import VOCAB, build_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 6}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLING = {"temperature": 1.0, "max_tokens": 800}


def _server_args(options: ToolServerOptions) -> dict:
    return {
        "api_key": "test-key",
        "app_options": {"tool_options": options},
        "kv_cache_memory": "32MiB",
    }


def tool_server(folder, options: ToolServerOptions):
    return running_server(folder, **_server_args(options))


# tests/serving/conftest.py's server: the long model with the hermes parser and auto choice
SERVER_ARGS = _server_args(
    ToolServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
)


@pytest.fixture(scope="module")
def server_model(long_model):
    return long_model


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny llama with room for a tools block (the tiny tokenizer spends ~1k tokens)."""
    folder = tmp_path_factory.mktemp("tools-llama")
    build_tiny_model("llama", vocab_size=VOCAB, max_position_embeddings=4096).save_pretrained(
        folder
    )
    build_tokenizer().save_pretrained(folder)
    return folder


def _check_calls(message, names) -> None:
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


async def test_required_gives_valid_tool_calls(server):
    client = server.async_client()
    for seed in range(3):
        for parallel in (False, True):
            response = await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=parallel,
                seed=seed,
                **SAMPLING,
            )
            choice = response.choices[0]
            if choice.finish_reason == "length":  # a random model may keep calling tools
                assert parallel
                continue
            assert choice.finish_reason == "tool_calls"
            _check_calls(choice.message, {"get_weather", "get_time"})
            if not parallel:
                assert len(choice.message.tool_calls) == 1


async def test_named_function_is_called(server):
    response = await server.async_client().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        n=2,
        **SAMPLING,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message, {"get_time"})
        assert len(choice.message.tool_calls) == 1


async def _assembled_stream(client, **kwargs):
    stream = await client.chat.completions.create(stream=True, **kwargs)
    content, calls, finish = "", {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                if piece.id is not None:
                    assert piece.index not in calls and piece.type == "function"
                    calls[piece.index] = [piece.function.name, piece.function.arguments or ""]
                else:
                    assert piece.function.name is None
                    calls[piece.index][1] += piece.function.arguments
            finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_streamed_deltas_assemble_to_the_non_streamed_result(server, tool_choice):
    client = server.async_client()
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice)
    kwargs.update(SAMPLING, seed=7, parallel_tool_calls=False)
    whole = (await client.chat.completions.create(**kwargs)).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    streamed = await _assembled_stream(client, **kwargs)
    assert streamed == (whole.message.content, calls, whole.finish_reason)


async def test_follow_up_with_tool_results(server):
    client = server.async_client()
    first = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, **SAMPLING,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    second = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    async with server.raw() as raw:
        response = await raw.post("/tokenize", json={"model": MODEL, "messages": messages})
    prompt = server.engine.tokenizer.decode(response.json()["tokens"])
    assert '<tool_response>\n{"forecast": "sunny"}\n</tool_response>' in prompt
    assert f'"name": "{call.function.name}"' in prompt


async def test_auto_parses_free_output(server):
    response = await server.async_client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=8
    )
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None


async def test_auto_without_the_flags_is_400(long_model):
    async with tool_server(long_model, ToolServerOptions()) as plain, plain.raw() as raw:
        if True:
            body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS}
            response = await raw.post("/v1/chat/completions", json=body)
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["param"] == "tool_choice"
            assert "--enable-auto-tool-choice" in error["message"]
            body["tool_choice"] = "required"  # needs no flag: the grammar is hermes'
            response = await raw.post("/v1/chat/completions", json={**body, "max_tokens": 100})
            assert response.status_code == 200


async def test_the_parser_is_detected_from_the_template_tool_requests_render_with():
    """A template that ignores `tools` (Phi-4-mini's reads message['tools']) is replaced by
    the shipped ChatML for tool requests, which teaches hermes: that is the format to parse,
    whatever the model's own template mentions."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% if m.tools %}functools[{% endif %}{% endfor %}"
    )
    assert _tools_template(tokenizer, ToolServerOptions()) == shipped_template()
    detected = ToolServerOptions(enable_auto_tool_choice=True).for_template(
        _tools_template(tokenizer, ToolServerOptions())
    )
    assert detected.tool_call_parser == "hermes"


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    (
        {
            "tool_choice": "required",
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}},
                }
            ],
        },
        "tools",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
async def test_bad_tool_requests_are_400(server, fields, param):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **fields}
    async with server.raw() as raw:
        response = await raw.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_bad_tool_call_arguments_in_messages_are_400(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{x"}}
    messages = [*MESSAGES, {"role": "assistant", "tool_calls": [call]}]
    async with server.raw() as raw:
        body = {"model": MODEL, "messages": messages, "max_tokens": 4}
        response = await raw.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "arguments" in response.json()["error"]["message"]


async def test_tool_aware_template_stands_in_for_one_that_ignores_tools(server):
    frontend = server.engine.frontend
    messages = [ChatMessage(**m) for m in MESSAGES]
    plain = await render_chat(frontend, messages, True, None)
    with_tools = await render_chat(frontend, messages, True, None, tools=TOOLS)
    assert "<tools>" not in plain and "<s>user:" in plain  # the model's own template
    assert "<tools>" in with_tools and '"name": "get_weather"' in with_tools
    assert with_tools.endswith("<|im_start|>assistant\n")


async def test_cli_flags_reach_the_app_and_the_frontend_child(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    argv = ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    ns = build_parser().parse_args([*argv, "--chat-template", str(template)])
    options = tool_options(ns)
    assert options.enable_auto_tool_choice and options.tool_call_parser == "hermes"
    assert options.chat_template == template.read_text()
    flags = frontend_flags(ns, [1234])
    assert "--enable-auto-tool-choice" in flags
    assert flags[flags.index("--chat-template") + 1] == str(template)
    assert flags[flags.index("--tool-call-parser") + 1] == "hermes"
    child = build_parser().parse_args(["frontend", *flags])
    assert tool_options(child) == options
    # without --tool-call-parser the parser comes from the model's chat template at start
    auto = tool_options(build_parser().parse_args(["serve", "--enable-auto-tool-choice"]))
    assert auto.enable_auto_tool_choice and auto.tool_call_parser is None
