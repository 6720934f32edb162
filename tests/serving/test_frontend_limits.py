"""Limits checked before tokenizing: a prompt over --max-prompt-bytes, more chat messages
than --max-messages, n over --max-n, max_tokens that cannot fit the context and an HTTP
body over --max-request-body-bytes are each refused with a 400 (gRPC INVALID_ARGUMENT)
that names the field and the limit, and the tokenizer never sees them."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio

from pagestream import AsyncEngine
from services.frontend.frontend_config import FrontendConfig
from tests.helpers.grpc_calls import request
from tests.helpers.servers import ENGINE, MODEL, inproc_frontend, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONFIG = FrontendConfig(max_prompt_bytes=64, max_messages=3, max_n=2, max_request_body_bytes=4096)
COMPLETIONS, CHAT, TOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize"
USER = {"role": "user", "content": "hi"}
LONG_USER = {"role": "user", "content": "y" * 65}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(model_dir):
    engine = AsyncEngine.from_args(str(model_dir("llama")), engine_core_process=False, **ENGINE)
    frontend = inproc_frontend(engine, CONFIG)
    encode = frontend.tokenizer.encode
    frontend.encoded = []

    def counting_encode(text, *args, **kwargs):
        frontend.encoded.append(text)
        return encode(text, *args, **kwargs)

    frontend.tokenizer.encode = counting_encode
    try:
        async with serving(frontend) as served:
            yield served
    finally:
        frontend.tokenizer.encode = encode
        await frontend.close()
        await engine.shutdown()


@pytest.mark.parametrize(
    ("path", "body", "param", "limit"),
    [
        (COMPLETIONS, {"prompt": "x" * 65}, "prompt", "--max-prompt-bytes"),
        (COMPLETIONS, {"prompt": ["ok", "é" * 33]}, "prompt", "--max-prompt-bytes"),
        (COMPLETIONS, {"prompt": "hi", "n": 3}, "n", "--max-n"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 256}, "max_tokens", "max_model_len"),
        (COMPLETIONS, {"prompt": list(range(3, 300))}, "prompt", "max_model_len"),
        (CHAT, {"messages": [USER] * 4}, "messages", "--max-messages"),
        (CHAT, {"messages": [LONG_USER]}, "messages", "--max-prompt-bytes"),
        (CHAT, {"messages": [USER], "n": 3}, "n", "--max-n"),
        (CHAT, {"messages": [USER], "max_tokens": 300}, "max_tokens", "max_model_len"),
        (TOKENIZE, {"prompt": "z" * 65}, "prompt", "--max-prompt-bytes"),
        (TOKENIZE, {"messages": [USER] * 4}, "messages", "--max-messages"),
    ],
)
async def test_http_limits_are_400_naming_the_field_and_the_limit(served, path, body, param, limit):
    served.frontend.encoded.clear()
    async with served.http_client() as client:
        response = await client.post(path, json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and limit in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert served.frontend.encoded == []  # refused before tokenizing


async def test_what_fits_the_limits_is_served(served):
    body = {"model": MODEL, "prompt": "x" * 64, "n": 2, "max_tokens": 2}
    async with served.http_client() as client:
        response = await client.post(COMPLETIONS, json=body)
        assert response.status_code == 200, response.text
        chat = {"model": MODEL, "messages": [USER] * 3, "max_tokens": 2}
        assert (await client.post(CHAT, json=chat)).status_code == 200


async def test_http_bodies_over_the_limit_are_400_before_they_are_read(served):
    big = {"model": MODEL, "prompt": "hi", "stop": ["s" * 100] * 50}
    async with served.http_client() as client:
        response = await client.post(COMPLETIONS, json=big)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "request_too_large"
        assert "--max-request-body-bytes" in error["message"] and "4096" in error["message"]

        async def chunks():  # no Content-Length: counted as it arrives
            yield b'{"model": "tiny-llama", "prompt": "hi", "user": "'
            for _ in range(10):
                yield b"u" * 1000
            yield b'"}'

        headers = {"content-type": "application/json"}
        response = await client.post(COMPLETIONS, content=chunks(), headers=headers)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "request_too_large"
        ok = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200


@pytest.mark.parametrize(
    ("prompt", "sampling", "field", "limit"),
    [
        ("x" * 65, {}, "text", "--max-prompt-bytes"),
        ([{"role": "user", "content": "c"}] * 4, {}, "chat.messages", "--max-messages"),
        ("hi", {"n": 3}, "sampling_params.n", "--max-n"),
        (list(range(3, 300)), {}, "token_ids", "max_model_len"),
    ],
)
async def test_grpc_limits_are_invalid_argument_naming_the_field(
    served, prompt, sampling, field, limit
):
    served.frontend.encoded.clear()
    async with served.stub() as stub:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(request(prompt, max_tokens=2, **sampling), timeout=60):
                pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(field) and limit in refused.value.details()
    assert served.frontend.encoded == []
