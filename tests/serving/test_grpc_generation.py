"""The public gRPC Generation service over a Frontend (in-process engine behind it).

Streams over gRPC must equal the in-process AsyncEngine's; unset sampling fields mean vLLM's
defaults; errors map to INVALID_ARGUMENT / UNAVAILABLE naming the field; cancelling a stream
aborts its request. Server lifecycle and reflection: test_grpc_frontend_server.py.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.tokenizer import apply_chat_template
from tests.helpers.eventually import eventually_async
from tests.helpers.grpc_calls import (
    CHAT,
    PROMPT_IDS,
    TEXT,
    TIMEOUT,
    assert_single_final_usage,
    collect,
    engine_idle,
    in_process,
    per_index,
    read_rest,
    request,
)


# ---- streaming equals the in-process engine ------------------------------------------------
async def test_greedy_stream_equals_in_process_engine(engine, stub):
    greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    chat_text = apply_chat_template(engine.tokenizer, CHAT)
    cases = [
        (PROMPT_IDS, {"prompt_token_ids": PROMPT_IDS}, {}),
        (TEXT, TEXT, {}),
        (CHAT, chat_text, {"add_special_tokens": False}),
    ]
    for grpc_prompt, local_prompt, kwargs in cases:
        responses = await collect(stub, request(grpc_prompt, **greedy))
        expected = await in_process(engine, local_prompt, SamplingParams(**greedy), **kwargs)
        got = per_index(responses)
        assert list(got) == [0]
        assert got[0]["token_ids"] == expected.outputs[0].token_ids
        assert got[0]["text"] == expected.outputs[0].text
        assert got[0]["finish"] == ["length"]
        assert len(responses) > 1  # streamed, not one final blob
        assert len({r.request_id for r in responses}) == 1 and responses[0].request_id
        assert_single_final_usage(responses, len(expected.prompt_token_ids), 8)


async def test_n2_outputs_are_told_apart_by_index(stub):
    message = request(PROMPT_IDS, n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    responses = await collect(stub, message)
    got = per_index(responses)
    assert sorted(got) == [0, 1]
    for index in (0, 1):
        assert len(got[index]["token_ids"]) == 6
        assert got[index]["finish"] == ["length"]  # exactly once per index
    assert_single_final_usage(responses, len(PROMPT_IDS), 12)


def spy_on_params(engine, monkeypatch) -> list[SamplingParams]:
    """Record the SamplingParams the Frontend receives."""
    seen: list[SamplingParams] = []
    original = engine.frontend.generate

    def spy(prompt, sampling_params=None, request_id=None, *args, **kwargs):
        seen.append(sampling_params)
        return original(prompt, sampling_params, request_id, *args, **kwargs)

    monkeypatch.setattr(engine.frontend, "generate", spy)
    return seen


async def test_unset_sampling_fields_are_vllm_defaults(engine, stub, monkeypatch):
    seen = spy_on_params(engine, monkeypatch)
    responses = await collect(stub, request(PROMPT_IDS, seed=11))
    expected = SamplingParams(seed=11, output_kind=RequestOutputKind.DELTA)
    assert seen == [expected]
    assert (seen[0].temperature, seen[0].top_p, seen[0].top_k, seen[0].n) == (1.0, 1.0, 0, 1)
    assert seen[0].max_tokens == 16 and seen[0].stop == [] and seen[0].logprobs is None
    # Seeded sampling at the default temperature reproduces the in-process engine's tokens.
    local = await in_process(engine, {"prompt_token_ids": PROMPT_IDS}, SamplingParams(seed=11))
    assert per_index(responses)[0]["token_ids"] == local.outputs[0].token_ids


async def test_explicit_zero_values_are_not_defaults(engine, stub, monkeypatch):
    seen = spy_on_params(engine, monkeypatch)
    await collect(stub, request(PROMPT_IDS, temperature=0.0, top_p=1.0, max_tokens=3))
    assert seen[0].temperature == 0.0 and seen[0].is_greedy and seen[0].max_tokens == 3


async def test_logprobs_and_prompt_logprobs_arrive(engine, stub):
    sampling = {"temperature": 0, "max_tokens": 5, "ignore_eos": True, "logprobs": 2}
    responses = await collect(stub, request(PROMPT_IDS, prompt_logprobs=1, **sampling))
    expected = await in_process(
        engine, {"prompt_token_ids": PROMPT_IDS}, SamplingParams(prompt_logprobs=1, **sampling)
    )
    positions = [p for r in responses for p in r.logprobs]
    tokens = [t for r in responses for t in r.token_ids]
    assert len(positions) == len(tokens) == 5
    for position, token_id, local in zip(
        positions, tokens, expected.outputs[0].logprobs, strict=True
    ):
        assert position.entries[0].token_id == token_id  # the chosen token first
        assert len(position.entries) >= 2
        assert position.entries[0].logprob == pytest.approx(local[token_id].logprob, abs=1e-5)
        assert position.entries[0].token == engine.tokenizer.decode([token_id])
    total = sum(p.entries[0].logprob for p in positions)
    assert responses[-1].cumulative_logprob == pytest.approx(total, abs=1e-4)
    with_prompt = [r for r in responses if r.prompt_logprobs]
    assert len(with_prompt) == 1 and with_prompt[0] is responses[0]  # once, first message
    prompt_positions = with_prompt[0].prompt_logprobs
    assert len(prompt_positions) == len(PROMPT_IDS)
    assert not prompt_positions[0].entries  # nothing to score the first prompt token with
    for position, token_id in zip(prompt_positions[1:], PROMPT_IDS[1:], strict=True):
        assert position.entries[0].token_id == token_id and position.entries[0].logprob <= 0


async def test_stop_string_and_stop_token_finish_reasons(engine, stub):
    greedy = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    full = await in_process(engine, {"prompt_token_ids": PROMPT_IDS}, SamplingParams(**greedy))
    text, ids = full.outputs[0].text, full.outputs[0].token_ids
    stop = next(
        piece
        for piece in (engine.tokenizer.decode([t]).strip() for t in ids[3:])
        if piece and text.find(piece) > 0
    )
    responses = await collect(stub, request(PROMPT_IDS, stop=[stop], **greedy))
    got = per_index(responses)
    assert got[0]["text"] == text[: text.find(stop)]
    assert got[0]["finish"] == ["stop"] and responses[-1].stop_string == stop
    assert_single_final_usage(responses, len(PROMPT_IDS), len(got[0]["token_ids"]))
    stop_token = ids[2]
    responses = await collect(stub, request(PROMPT_IDS, stop_token_ids=[stop_token], **greedy))
    got = per_index(responses)
    assert got[0]["finish"] == ["stop"]
    assert responses[-1].WhichOneof("stop_reason") == "stop_token_id"
    assert responses[-1].stop_token_id == stop_token
    assert got[0]["token_ids"] == ids[: ids.index(stop_token) + 1]


# ---- the small RPCs ------------------------------------------------------------------------
async def test_tokenize_detokenize_round_trip_and_model_info(engine, stub):
    tokens = await stub.Tokenize(pb.TokenizeRequest(text=TEXT), timeout=TIMEOUT)
    assert list(tokens.token_ids) == engine.tokenizer.encode(TEXT)
    assert tokens.count == len(tokens.token_ids)
    assert tokens.max_model_len == engine.info.max_model_len
    text = await stub.Detokenize(pb.DetokenizeRequest(token_ids=tokens.token_ids), timeout=TIMEOUT)
    assert text.text == TEXT
    chat = pb.TokenizeRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(**CHAT[0])]))
    chat_tokens = await stub.Tokenize(chat, timeout=TIMEOUT)
    rendered = apply_chat_template(engine.tokenizer, CHAT)
    assert list(chat_tokens.token_ids) == engine.tokenizer.encode(
        rendered, add_special_tokens=False
    )
    info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.max_model_len == engine.info.max_model_len
    assert info.vocab_size == engine.info.vocab_size
    assert tuple(info.eos_token_ids) == engine.info.eos_token_ids
    assert info.model == engine.info.model and info.num_gpu_blocks == engine.info.num_device_blocks


# ---- errors --------------------------------------------------------------------------------
def _unknown_field(message) -> bytes:
    return message.SerializeToString() + bytes([0xA8, 0x02, 0x05])  # field 37, varint 5


BAD_REQUESTS = {
    "empty text": (request(""), "text"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids"),
    "missing prompt": (pb.GenerateRequest(), "prompt"),
    "temperature 5": (request(TEXT, temperature=5.0), "temperature"),
    "n=0": (request(TEXT, n=0), "n must"),
    "stop with an empty string": (request(TEXT, stop=[""]), "stop"),
    "prompt too long": (request([5] * 100_000), "max_model_len"),
    "unknown role": (request([{"role": "robot", "content": "hi"}]), "role"),
    "unknown stop token": (request(TEXT, stop_token_ids=[10**6]), "stop_token_ids"),
    "out-of-vocab prompt": (request([10**6]), "vocabulary"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
async def test_bad_request_is_invalid_argument_naming_the_field(stub, case):
    message, field = BAD_REQUESTS[case]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, message)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


async def test_unknown_fields_and_bad_detokenize_are_invalid_argument(channel, stub):
    generate = channel.unary_stream(
        "/pagestream.v1.Generation/Generate", response_deserializer=pb.GenerateResponse.FromString
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [r async for r in generate(_unknown_field(request(TEXT)), timeout=TIMEOUT)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown field" in err.value.details() and "37" in err.value.details()
    nested = request(TEXT)
    nested.sampling_params.ParseFromString(_unknown_field(nested.sampling_params))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, nested)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params has unknown field" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 10**6]), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids[1]" in err.value.details()
    # The server keeps serving after bad requests.
    responses = await collect(stub, request(PROMPT_IDS, max_tokens=2, ignore_eos=True))
    assert per_index(responses)[0]["finish"] == ["length"]


async def test_engine_that_is_gone_is_unavailable(engine, grpc_server, channel, stub, monkeypatch):
    def broken_step():
        raise RuntimeError("worker lost")

    monkeypatch.setattr(engine.engine_core.core, "step", broken_step)
    for _ in range(2):  # the request that finds the loop dying, then one after it
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, request(PROMPT_IDS, max_tokens=4))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    health = health_pb2_grpc.HealthStub(channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
    async for status in watch:
        if status.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
    watch.cancel()
    assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING


# ---- cancellation and abort ----------------------------------------------------------------
async def test_client_cancellation_aborts_the_request(engine, stub):
    call = stub.Generate(request(PROMPT_IDS, max_tokens=100_000, ignore_eos=True))
    received = 0
    async for _ in call:
        received += 1
        if received == 2:
            break
    assert engine.engine.has_unfinished_requests()
    call.cancel()
    await eventually_async(lambda: engine_idle(engine), "the cancelled request aborted")
    assert engine.engine.scheduler.kv.usage == 0.0  # its KV blocks came back
    assert engine.frontend.num_live_requests() == 0


async def test_abort_rpc_ends_the_stream_with_abort_and_usage(engine, stub):
    message = request(PROMPT_IDS, max_tokens=100_000, ignore_eos=True)
    message.request_id = "to-abort"
    call = stub.Generate(message, timeout=TIMEOUT)
    responses = [await call.read()]
    found = await stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=TIMEOUT)
    assert found.found
    responses += await read_rest(call)
    assert responses[-1].finish_reason == "abort"
    completion = sum(len(r.token_ids) for r in responses)
    assert_single_final_usage(responses, len(PROMPT_IDS), completion)
    missing = await stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=TIMEOUT)
    assert not missing.found
    await eventually_async(lambda: engine_idle(engine), "the engine idle")
