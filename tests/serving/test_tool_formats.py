"""Every tool-call format through a served model and the official `openai` client: a
scripted tiny model (tests/helpers/scripted_model.py) replies with a known text in the
format, split into pieces that cut through its markers, and the server's parser must
give exactly the calls (and content) written, whole and streamed alike."""

from __future__ import annotations

import json

import anthropic
import pytest

from services.frontend.tool_options import ToolServerOptions
from tests.helpers.openai_server import API_KEY, MODEL, running_server
from tests.helpers.scripted_model import build_scripted_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days, and the time in UTC?"}]
WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"zone": "UTC"})

# parser -> (reply pieces, content, calls)
FORMATS = {
    "hermes": (
        [
            "Let me check.",
            "\n<tool_",
            'call>\n{"name": "get_weather", ',
            '"arguments": {"city": "Paris", "days": 3}}',
            "\n</tool_call>",
            '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
        ],
        "Let me check.\n",  # the text before the first marker, as written (vLLM's too)
        [WEATHER, TIME],
    ),
    "qwen3_coder": (
        [
            "<tool_call>",
            "\n<function=get_weather>",
            "\n<parameter=city>\nParis\n</parameter>",
            "\n<parameter=days>\n3\n</para",
            "meter>\n</function>\n</tool_call>",
        ],
        None,
        [WEATHER],
    ),
    "mistral": (
        [
            "[TOOL_CALLS]",
            '[{"name": "get_weather", "arguments": ',
            '{"city": "Paris", "days": 3}}, ',
            '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
        ],
        None,
        [WEATHER, TIME],
    ),
    "pythonic": (
        ["[get_weather(city=", "'Paris', days=3)", ", get_time(zone='UTC')]"],
        None,
        [WEATHER, TIME],
    ),
    "llama3_json": (
        ["<|python_tag|>", '{"name": "get_time", ', '"parameters": {"zone": "UTC"}}'],
        None,
        [TIME],
    ),
    "phi4_mini_json": (
        ["functools", '[{"name": "get_time", ', '"arguments": {"zone": "UTC"}}]'],
        None,
        [TIME],
    ),
}
# Mistral's newer tokenizers: [TOOL_CALLS]NAME[ARGS]{...} per call
MISTRAL_ARGS_FORM = (
    ["[TOOL_CALLS]", "get_time", "[ARGS]", '{"zone": ', '"UTC"}'],
    None,
    [TIME],
)
CASES = [(name, *case) for name, case in FORMATS.items()] + [("mistral", *MISTRAL_ARGS_FORM)]


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


@pytest.mark.parametrize(("parser", "pieces", "content", "calls"), CASES)
async def test_the_format_parses_exactly_whole_and_streamed(
    tmp_path, parser, pieces, content, calls
):
    folder = build_scripted_model(tmp_path, {None: pieces})
    options = ToolServerOptions(enable_auto_tool_choice=True, tool_call_parser=parser)
    async with running_server(folder, app_options={"tool_options": options}) as server:
        client = server.async_client()
        request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0}
        response = await client.chat.completions.create(**request, max_tokens=60)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert (choice.message.content or None) == content
        assert _calls(choice.message.tool_calls) == calls
        if parser == "mistral":  # Mistral's templates need 9-character alphanumeric ids
            assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)

        stream = await client.chat.completions.create(**request, max_tokens=60, stream=True)
        text, pieces_by_index, finish = "", {}, None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
                for piece in c.delta.tool_calls or []:
                    entry = pieces_by_index.setdefault(piece.index, {"name": "", "args": ""})
                    entry["name"] += piece.function.name or ""
                    entry["args"] += piece.function.arguments or ""
        streamed = [(e["name"], json.loads(e["args"])) for _, e in sorted(pieces_by_index.items())]
        assert (text or None, streamed, finish) == (content, calls, "tool_calls")

        await _check_anthropic(server, content, calls)


async def _check_anthropic(server, content, calls) -> None:
    """The same reply through the Messages API: text, then tool_use blocks."""
    client = anthropic.AsyncAnthropic(base_url=server.http.url, api_key=API_KEY, max_retries=0)
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    request = {"model": MODEL, "max_tokens": 60, "messages": MESSAGES, "tools": tools}
    message = await client.messages.create(**request, extra_body={"temperature": 0})
    texts = [b.text for b in message.content if b.type == "text"]
    uses = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert ("".join(texts) or None, uses) == (content, calls)
    assert message.stop_reason == "tool_use"
    async with client.messages.stream(**request, extra_body={"temperature": 0}) as stream:
        final = await stream.get_final_message()
    assert _blocks(final.content) == _blocks(message.content)


def _blocks(content) -> list[dict]:
    """Content blocks as plain dicts, without the ids each reply draws anew."""
    return [block.model_dump(exclude={"parsed_output", "citations", "id"}) for block in content]
