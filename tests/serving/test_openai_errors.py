"""OpenAI error bodies over raw HTTP: 400 naming the field (bad values, wrong types,
malformed JSON, too-long prompts), 404 unknown model or route, 401 without the API key,
503 when the engine is gone, 429 for overload; and the server keeps serving after each."""

import openai
import pytest

from services.frontend.openai.errors import OverloadedError, to_openai_error
from tests.helpers.openai_server import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}


async def _post(server, path: str, body=None, *, content=None, api_key="test-key", headers=None):
    async with server.raw(api_key=api_key) as client:
        if content is not None:
            return await client.post(path, content=content, headers=headers or {})
        return await client.post(path, json=body)


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, _completion(temperature=5), "temperature"),
        (COMPLETIONS, _completion(top_p=0), "top_p"),
        (COMPLETIONS, _completion(n=0), "n"),
        (COMPLETIONS, _completion(logprobs=50), "logprobs"),
        (COMPLETIONS, _completion(max_tokens=-1), "max_tokens"),
        (COMPLETIONS, _completion(presence_penalty=9), "presence_penalty"),
        (COMPLETIONS, _completion(logit_bias={"abc": 1}), "logit_bias"),
        (COMPLETIONS, _completion(logit_bias={"100000": 1}), "logit_bias"),
        (COMPLETIONS, _completion(stop_token_ids=["x"]), "stop_token_ids[0]"),
        (COMPLETIONS, _completion(min_tokens=5), "min_tokens"),
        (COMPLETIONS, _completion(suffix="!"), "suffix"),
        (COMPLETIONS, _completion(stream_options={"include_usage": True}), "stream_options"),
        (COMPLETIONS, _completion(temperature="hot"), "temperature"),
        (COMPLETIONS, _completion(prompt=[]), "prompt"),
        (COMPLETIONS, _completion(prompt=[10**7]), "prompt"),
        (COMPLETIONS, {"model": MODEL}, "prompt"),
        (CHAT, _chat(messages=[]), "messages"),
        (CHAT, _chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
        (CHAT, _chat(top_logprobs=2), "top_logprobs"),
        (CHAT, _chat(logprobs=True, top_logprobs=99), "top_logprobs"),
        (CHAT, _chat(max_completion_tokens=0), "max_completion_tokens"),
        (CHAT, _chat(chat_template="{% if %}"), "chat_template"),
        (CHAT, _chat(n=2, temperature=0), "n"),
    ],
)
async def test_bad_values_are_400_naming_the_field(server, path, body, param):
    error = _error(await _post(server, path, body), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


async def test_prompts_longer_than_the_context_are_400(server):
    too_long = _completion(prompt=list(range(3, 3 + 300)))
    error = _error(await _post(server, COMPLETIONS, too_long), 400)
    assert error["param"] == "prompt" and "256" in error["message"]
    assert error["code"] == "context_length_exceeded"  # OpenAI's: clients trim history on it
    over_budget = _completion(prompt=list(range(3, 3 + 250)), max_tokens=10)
    error = _error(await _post(server, COMPLETIONS, over_budget), 400)
    assert error["param"] == "max_tokens" and "maximum context length" in error["message"]
    assert error["code"] == "context_length_exceeded"
    chat = _chat(messages=[{"role": "user", "content": "fox " * 400}])
    error = _error(await _post(server, CHAT, chat), 400)
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (b'{"model": "tiny-llama", "prompt": ', {"content-type": "application/json"}),
        (b"[1, 2, 3]", {"content-type": "application/json"}),
        (b"", {"content-type": "application/json"}),
        (b'{"prompt": NaN, "temperature": NaN}', {"content-type": "application/json"}),
        (b"\xff\xfe not utf-8", {"content-type": "application/json"}),
    ],
)
async def test_malformed_bodies_are_400(server, content, headers):
    response = await _post(server, COMPLETIONS, content=content, headers=headers)
    assert _error(response, 400)["type"] == "invalid_request_error"


async def test_unknown_model_is_404(server):
    for path, body in ((COMPLETIONS, _completion(model="gpt-9")), (CHAT, _chat(model="gpt-9"))):
        error = _error(await _post(server, path, body), 404)
        assert (error["param"], error["code"]) == ("model", "model_not_found")
        assert "gpt-9" in error["message"]
    async with server.raw() as client:
        _error(await client.get("/v1/models/gpt-9"), 404)
        _error(await client.get("/v1/nothing-here"), 404)
        _error(await client.get(COMPLETIONS), 405)


async def test_api_key_guards_v1_only(server):
    for key in (None, "wrong-key"):
        error = _error(await _post(server, COMPLETIONS, _completion(), api_key=key), 401)
        assert error["code"] == "invalid_api_key"
        async with server.raw(api_key=key) as client:
            _error(await client.get("/v1/models"), 401)
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/metrics")).status_code == 200


async def test_openai_client_raises_the_matching_errors(server):
    client = server.async_client()
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model=MODEL, prompt="x", temperature=7)
    assert bad.value.status_code == 400 and "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="bad", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()


async def test_dead_engine_is_503_and_both_probes_say_so(server):
    """An engine that can never come back: not ready, and not alive (restart the process)."""
    frontend = server.engine.frontend
    frontend.dead_error = RuntimeError("simulated loss of the engine core")
    try:
        error = _error(await _post(server, COMPLETIONS, _completion()), 503)
        assert error["type"] == "server_error"
        async with server.raw() as client:
            _error(await client.get("/health"), 503)
            _error(await client.get("/ready"), 503)
    finally:
        frontend.dead_error = None


async def test_an_engine_that_is_away_is_not_ready_but_alive(server, monkeypatch):
    """Workers away (the engine core reconnects): /ready 503, /health stays 200."""
    async with server.raw(api_key=None) as client:
        assert (await client.get("/ready")).status_code == 200
        monkeypatch.setattr(server.engine.engine_core, "ready", False)
        assert (await client.get("/health")).status_code == 200
        error = _error(await client.get("/ready"), 503)
        assert "reconnecting" in error["message"]
    error = _error(await _post(server, COMPLETIONS, _completion()), 503)
    assert error["code"] == "engine_unavailable"


async def test_overload_maps_to_429():
    error = to_openai_error(OverloadedError("too many requests in flight"))
    assert error.status == 429 and error.body()["error"]["code"] == "rate_limit_exceeded"


async def test_server_still_serves_after_the_errors(server):
    async with server.raw() as client:
        response = await client.post(COMPLETIONS, json=_completion(ignore_eos=True))
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "length"
    samples = await server.wait_until_idle()
    assert samples['pagestream:kv_cache_usage_perc{engine="0"}'] == 0
