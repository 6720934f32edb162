"""Requests' own chat templates: refused by default on every API; when the operator trusts
them, rendered in the sandbox exactly as transformers renders them inline, and a render
cut short (timeout, cancelled request) leaves no child process behind."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from pagestream import AsyncEngine
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.frontend import chat_templates
from services.frontend.chat_renderer import ChatRenderer, ChatTemplateError
from services.frontend.frontend_config import FrontendConfig
from services.frontend.request_limits import LimitExceededError
from tests.helpers.grpc_calls import request
from tests.helpers.servers import ENGINE, MODEL, inproc_frontend, serving
from tests.helpers.tiny_tokenizer import build_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
# A template in the shape of Qwen's: tools as JSON lines, tool calls, the generation prompt.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n"
    "{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token }}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(model_dir):
    engine = AsyncEngine.from_args(str(model_dir("llama")), engine_core_process=False, **ENGINE)
    frontend = inproc_frontend(engine, FrontendConfig())  # the defaults: not trusted
    try:
        async with serving(frontend) as served:
            yield served
    finally:
        await frontend.close()
        await engine.shutdown()


def assert_names_the_flag(error: dict) -> None:
    assert error["param"] == "chat_template", error
    assert "--trust-request-chat-template" in error["message"], error


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_http_refuses_request_templates_by_default(served, path):
    async with served.http_client() as http:
        body = {"model": MODEL, "messages": USER, "chat_template": TEMPLATE, "max_tokens": 2}
        response = await http.post(path, json=body)
    assert response.status_code == 400
    assert_names_the_flag(response.json()["error"])


async def test_grpc_refuses_request_templates_by_default(served):
    chat = request(USER, max_tokens=2)
    chat.chat.chat_template = TEMPLATE
    async with served.stub() as stub:
        with pytest.raises(grpc.aio.AioRpcError) as generate:
            [r async for r in stub.Generate(chat, timeout=30)]
        with pytest.raises(grpc.aio.AioRpcError) as tokenize:
            await stub.Tokenize(pb.TokenizeRequest(chat=chat.chat), timeout=30)
    for caught in (generate, tokenize):
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--trust-request-chat-template" in caught.value.details()


async def test_the_models_template_still_renders(served):
    async with served.http_client() as http:
        response = await http.post("/tokenize", json={"model": MODEL, "messages": USER})
    assert response.status_code == 200 and response.json()["count"] > 0


def trusted(tokenizer, **config) -> ChatRenderer:
    return ChatRenderer(
        tokenizer, FrontendConfig(trust_request_chat_template=True, **config), 1 << 20
    )


@pytest.mark.parametrize(
    ("messages", "tools"),
    [
        (USER, None),
        (USER, TOOLS),
        ([*USER, {"role": "assistant", "content": "", "tool_calls": [CALL]}], TOOLS),
    ],
    ids=["plain", "tools", "tool-call"],
)
async def test_the_sandbox_renders_what_transformers_renders(messages, tools):
    tokenizer = build_tokenizer()
    renderer = trusted(tokenizer)
    try:
        text = await renderer.render(
            messages, True, request_template=TOOLS_TEMPLATE, tools=tools, uses_tools=bool(tools)
        )
    finally:
        await renderer.close()
    expected = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=TOOLS_TEMPLATE, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    assert text == expected and ("<tools>" in text) == bool(tools)


async def test_a_template_over_the_size_limit_is_refused_before_rendering():
    renderer = trusted(build_tokenizer(), max_chat_template_bytes=64)
    with pytest.raises(LimitExceededError, match="--max-chat-template-bytes"):
        await renderer.render(USER, request_template="{{ 'x' }}" * 10)
    assert renderer._sandbox is None  # nothing was started for it


async def test_a_cancelled_render_kills_the_child_and_the_next_render_works():
    renderer = trusted(build_tokenizer(), chat_template_timeout_s=30)
    slow = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"
    try:
        task = asyncio.ensure_future(renderer.render(USER, request_template=slow))
        await asyncio.sleep(0)
        while renderer._sandbox is None or renderer._sandbox._process is None:
            await asyncio.sleep(0.05)
        child = renderer._sandbox._process
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert child.returncode is not None  # killed, not left running the loops
        assert (
            await renderer.render(USER, request_template=TEMPLATE) == "[user] " + USER[0]["content"]
        )
    finally:
        await renderer.close()


async def test_a_failing_template_is_a_chat_template_error():
    renderer = trusted(build_tokenizer())
    try:
        with pytest.raises(ChatTemplateError, match="boom"):
            await renderer.render(USER, request_template="{{ raise_exception('boom') }}")
    finally:
        await renderer.close()


def test_the_tool_probe_cache_is_bounded():
    tokenizer = build_tokenizer()
    for i in range(3 * chat_templates._SEEN_MAX):
        chat_templates.renders_tools(tokenizer, f"{{{{ messages[0].content }}}} {i}")
    assert len(chat_templates._seen) <= chat_templates._SEEN_MAX
