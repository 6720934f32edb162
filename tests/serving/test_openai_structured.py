"""Structured outputs over the OpenAI API: response_format (json_object, json_schema),
vLLM's structured_outputs object and the guided_* aliases on completions and chat give
valid output (tiny random model, official `openai` client, streaming and not); every bad
constraint is a 400 naming the field (and INVALID_ARGUMENT over gRPC), never dropped."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import pytest

from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from services.frontend.frontend_server import serve_frontend
from services.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.helpers.grpc_calls import TEXT, TIMEOUT, request
from tests.helpers.openai_server import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="module")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["city", "days", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Weather as JSON please."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
SAMPLING = {"temperature": 1.0, "max_tokens": 200}


# ---- the request -> StructuredOutputsParams mapping ------------------------------------------
def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


async def test_response_format_json_schema_maps_to_json_and_strict_changes_nothing():
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    params = _chat(response_format=fmt).structured_outputs_params()
    assert params.kind == "json" and params.json == SCHEMA
    assert not params.disable_additional_properties  # vLLM ignores strict as well


async def test_each_form_maps_to_its_kind():
    forms = {
        "json_object": {"response_format": {"type": "json_object"}},
        "regex": {"structured_outputs": {"regex": "[a-z]{3}"}},
        "choice": {"guided_choice": ["yes", "no"]},
        "grammar": {"guided_grammar": 'start: "a" | "b"'},
        "json": {"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
    }
    for kind, fields in forms.items():
        params = CompletionRequest(prompt="x", **fields).structured_outputs_params()
        assert params.kind == kind
    params = _chat(guided_json=SCHEMA, guided_whitespace_pattern=" ?").structured_outputs_params()
    assert params.whitespace_pattern == " ?"
    options = {
        "json": SCHEMA,
        "disable_any_whitespace": True,
        "disable_additional_properties": True,
    }
    params = _chat(structured_outputs=options).structured_outputs_params()
    assert params.disable_any_whitespace and params.disable_additional_properties
    assert _chat(response_format={"type": "text"}).structured_outputs_params() is None


# ---- 400s over HTTP ---------------------------------------------------------------------------
BAD_REQUESTS = [
    ({"response_format": RESPONSE_FORMAT, "guided_regex": "a+"}, "guided_regex", "at most one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "structural_tag"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", ""),
    ({"guided_json": {"type": "nonsense"}}, "guided_json", "nonsense"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"guided_grammar": "start: ???"}, "guided_grammar", "grammar"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "JSON constraint"),
    ({"guided_choice": ["a"], "guided_whitespace_pattern": " "}, "guided_choice", "guided_json"),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD_REQUESTS)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_bad_constraints_are_400_naming_the_field(server, path, fields, param, words):
    body = {"model": MODEL, "max_tokens": 4, **fields}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "x"})
    async with server.raw() as client:
        response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


async def test_beam_search_with_a_constraint_is_refused(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "n": 2, "use_beam_search": True}
    async with server.raw() as client:
        response = await client.post("/v1/completions", json={**body, "guided_choice": ["a"]})
    assert response.status_code == 400 and "beam search" in response.json()["error"]["message"]


# ---- 400s over gRPC ---------------------------------------------------------------------------
async def test_grpc_bad_constraints_are_invalid_argument(server):
    handle = await serve_frontend(server.engine.frontend, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            bad = [
                (pb.StructuredOutputs(json=json.dumps({"uniqueItems": True})), "uniqueItems"),
                (pb.StructuredOutputs(regex="(unclosed"), "regex"),
                (pb.StructuredOutputs(json="{not json"), "json"),
            ]
            for constraint, words in bad:
                message = request(TEXT, max_tokens=4)
                message.sampling_params.structured_outputs.CopyFrom(constraint)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    _ = [r async for r in stub.Generate(message, timeout=TIMEOUT)]
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert words in err.value.details()
            message = request(TEXT, max_tokens=8)
            message.sampling_params.structured_outputs.choice.choices.extend(["yes", "no"])
            texts = [r.text async for r in stub.Generate(message, timeout=TIMEOUT)]
            assert "".join(texts) in ("yes", "no")
    finally:
        await handle.stop(grace=None)


# ---- valid output -----------------------------------------------------------------------------
async def test_json_schema_output_validates_streaming_and_not(server):
    client = server.async_client()
    for seed in range(4):
        response = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format=RESPONSE_FORMAT, seed=seed, **SAMPLING
        )
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format=RESPONSE_FORMAT,
            seed=seed,
            stream=True,
            **SAMPLING,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == choice.message.content


async def test_json_object_regex_choice_and_n(server):
    client = server.async_client()
    response = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        n=3,
        extra_body={"structured_outputs": None},
        **SAMPLING,
    )
    for choice in response.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    completion = await client.completions.create(
        model=MODEL, prompt="Code:", n=2, extra_body={"structured_outputs": {"regex": "[a-f]{4}"}}
    )
    assert all(re.fullmatch("[a-f]{4}", c.text) for c in completion.choices)
    completion = await client.completions.create(
        model=MODEL, prompt="Answer:", extra_body={"guided_choice": ["yes", "no", "maybe"]}
    )
    assert completion.choices[0].text in ("yes", "no", "maybe")


async def test_constrained_and_free_requests_together(server):
    client = server.async_client()
    free = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    alone = await client.completions.create(model=MODEL, prompt="The quick", **free)
    together = await asyncio.gather(
        client.completions.create(model=MODEL, prompt="The quick", **free),
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format=RESPONSE_FORMAT, **SAMPLING
        ),
    )
    assert together[0].choices[0].text == alone.choices[0].text
    jsonschema.validate(json.loads(together[1].choices[0].message.content), SCHEMA)
