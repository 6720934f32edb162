"""chat_template_kwargs: the server's defaults (--default-chat-template-kwargs) under the
request's, reserved names refused, the same variables inline and in the sandbox; an
assistant turn's thinking reaches the template as reasoning_content."""

from __future__ import annotations

import pytest

from services.frontend.chat_renderer import ChatRenderer
from services.frontend.frontend_config import FrontendConfig
from services.frontend.openai.chat_messages import ChatMessage
from services.frontend.request_limits import LimitExceededError
from tests.helpers.tiny_tokenizer import build_tokenizer

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
    "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %};{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    "{% if style %}<{{ style }}>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def _renderer(tokenizer, **config) -> ChatRenderer:
    return ChatRenderer(tokenizer, FrontendConfig(**config), 0)


async def test_request_kwargs_override_the_servers_defaults(tokenizer):
    renderer = _renderer(
        tokenizer, default_chat_template_kwargs='{"enable_thinking": false, "style": "terse"}'
    )
    assert await renderer.render(MESSAGES) == "user:hi;<no-think><terse>"
    text = await renderer.render(MESSAGES, template_kwargs={"enable_thinking": True})
    assert text == "user:hi;<terse>"


async def test_the_sandbox_gets_the_same_variables(tokenizer):
    renderer = _renderer(tokenizer, trust_request_chat_template=True)
    try:
        text = await renderer.render(
            MESSAGES, request_template=TEMPLATE, template_kwargs={"style": "x"}
        )
    finally:
        await renderer.close()
    assert text == "user:hi;<x>"


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "not a name"])
async def test_reserved_or_odd_names_are_refused(tokenizer, key):
    with pytest.raises(LimitExceededError, match="chat_template_kwargs") as caught:
        await _renderer(tokenizer).render(MESSAGES, template_kwargs={key: 1})
    assert caught.value.param == "chat_template_kwargs"


@pytest.mark.parametrize("value", ["{not json", "[1, 2]"])
def test_a_bad_server_default_fails_at_start(value):
    with pytest.raises(ValueError, match="default_chat_template_kwargs"):
        FrontendConfig(default_chat_template_kwargs=value)


async def test_an_assistant_turns_thinking_reaches_the_template(tokenizer):
    messages = [
        ChatMessage(role="user", content="q"),
        ChatMessage(role="assistant", content="a", reasoning_content="because"),
        ChatMessage(role="assistant", content="b", reasoning="vllm name"),
    ]
    text = await _renderer(tokenizer).render(
        [m.as_template_message(i) for i, m in enumerate(messages)]
    )
    assert text == "user:q;assistant:a[because];assistant:b[vllm name];"
