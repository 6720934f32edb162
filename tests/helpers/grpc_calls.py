"""Helpers shared by the gRPC Generation tests (requests, stream collection, idleness)."""

from __future__ import annotations

import grpc

from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.sampling_params import SamplingParams

TIMEOUT = 60
PROMPT_IDS = [5, 17, 33, 99, 250, 12, 8, 41]
TEXT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Paged attention stores keys"}]


def request(prompt=None, **sampling) -> pb.GenerateRequest:
    """A GenerateRequest: prompt is text, a list of ids, or chat messages (list of dicts)."""
    message = pb.GenerateRequest(sampling_params=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        message.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        message.chat.messages.extend(pb.ChatMessage(**m) for m in prompt)
    elif prompt is not None:
        message.token_ids.token_ids.extend(prompt)
    return message


async def read_rest(call) -> list[pb.GenerateResponse]:
    """The remaining messages of a call that was read with call.read()."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


async def collect(stub, message) -> list[pb.GenerateResponse]:
    return [r async for r in stub.Generate(message, timeout=TIMEOUT)]


def per_index(responses) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for r in responses:
        entry = out.setdefault(r.index, {"text": "", "token_ids": [], "finish": []})
        entry["text"] += r.text
        entry["token_ids"] += list(r.token_ids)
        if r.finish_reason:
            entry["finish"].append(r.finish_reason)
    return out


async def in_process(engine, prompt, params: SamplingParams, **kwargs):
    final = None
    async for output in engine.generate(prompt, params, **kwargs):
        final = output
    return final


def assert_single_final_usage(responses, prompt_tokens: int, completion_tokens: int) -> None:
    with_usage = [i for i, r in enumerate(responses) if r.HasField("usage")]
    assert with_usage == [len(responses) - 1]
    usage = responses[-1].usage
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == completion_tokens


def engine_idle(engine) -> bool:
    """No unfinished request and no KV block in use (a condition for eventually_async)."""
    return not engine.engine.has_unfinished_requests() and not engine.engine.scheduler.kv.usage


def reflected_method(target: str, method: str) -> tuple[type, type]:
    """(request class, response class) of pagestream.v1.Generation's `method`, built from
    the server's reflection alone (no generated module); blocking, run it in a thread."""
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(target) as sync_channel:
        database = ProtoReflectionDescriptorDatabase(sync_channel)
        assert "pagestream.v1.Generation" in database.get_services()
        pool = descriptor_pool.DescriptorPool(database)
        found = pool.FindServiceByName("pagestream.v1.Generation").FindMethodByName(method)
        return (
            message_factory.GetMessageClass(found.input_type),
            message_factory.GetMessageClass(found.output_type),
        )
