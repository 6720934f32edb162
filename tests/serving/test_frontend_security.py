"""The frontend's security: the API key guards the public gRPC API as it guards HTTP /v1
(`authorization: Bearer KEY` metadata, UNAUTHENTICATED otherwise; health stays open for
probes); the public gRPC port speaks TLS with a certificate made in the test (plaintext
and clients that do not trust its CA are refused); the frontend reaches a scheduler that
demands mutual TLS with its own certificate, and cannot without one."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from services.common.tls import TlsConfig
from services.frontend.frontend_server import connect_frontend, serve_frontend
from services.frontend.tokenizer import load_tokenizer
from services.scheduler.engine_core_service import serve_scheduler
from services.worker.worker_service import serve_worker
from tests.common.certs import make_pki
from tests.helpers.grpc_calls import PROMPT_IDS, collect, request
from tests.helpers.servers import ENGINE, engine_args, serving

ENGINE_ARGS = ENGINE  # for tests/conftest.py's engine
KEY = "sesame"
GREEDY = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}


@pytest.fixture
def pki(tmp_path):
    return make_pki(tmp_path)


async def _generate(channel, metadata=None) -> int:
    stub = generation_pb2_grpc.GenerationStub(channel)
    responses = [
        r async for r in stub.Generate(request(PROMPT_IDS, **GREEDY), metadata=metadata, timeout=60)
    ]
    return sum(len(r.token_ids) for r in responses)


async def test_the_api_key_guards_the_grpc_api_and_health_stays_open(engine):
    async with serving(engine.frontend, api_key=KEY) as served:
        async with grpc.aio.insecure_channel(served.grpc_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _generate(channel, metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "API key" in refused.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            good = (("authorization", f"Bearer {KEY}"),)
            assert await _generate(channel, good) == GREEDY["max_tokens"]
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=good, timeout=60)
            assert info.max_model_len > 0
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        async with served.http_client(api_key="wrong") as client:
            assert (await client.get("/v1/models")).status_code == 401
        async with served.http_client(api_key=KEY) as client:
            assert (await client.get("/v1/models")).status_code == 200


async def test_the_public_grpc_port_speaks_tls(engine, pki):
    server_tls = TlsConfig(pki.server.cert, pki.server.key)
    handle = await serve_frontend(engine.frontend, "127.0.0.1", 0, tls=server_tls)
    address = f"127.0.0.1:{handle.port}"
    try:
        trusted = grpc.ssl_channel_credentials(Path(pki.ca).read_bytes())
        async with grpc.aio.secure_channel(address, trusted) as channel:
            assert await _generate(channel) == GREEDY["max_tokens"]
        other_ca = Path(pki.ca).with_name("other-ca.pem").read_bytes()
        strangers = grpc.ssl_channel_credentials(other_ca)
        for channel in (
            grpc.aio.insecure_channel(address),
            grpc.aio.secure_channel(address, strangers),
        ):
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _generate(channel)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await handle.stop(grace=None)


async def test_the_frontend_reaches_a_mutual_tls_scheduler_only_with_a_certificate(model_dir, pki):
    folder = model_dir("llama")
    args = engine_args(folder)
    server_tls = TlsConfig(pki.server.cert, pki.server.key, pki.ca)
    worker = await serve_worker(args.model_config(), args.cache_config(), tls=server_tls)
    scheduler = await serve_scheduler(worker.address, args, worker_timeout_s=60, tls=server_tls)
    tokenizer = load_tokenizer(folder)
    try:
        client_tls = TlsConfig(pki.client.cert, pki.client.key, pki.ca)
        frontend = await connect_frontend(
            scheduler.address, tokenizer, timeout_s=60, tls=client_tls
        )
        try:
            async with serving(frontend) as served, served.stub() as stub:
                responses = await collect(stub, request(PROMPT_IDS, **GREEDY))
                assert sum(len(r.token_ids) for r in responses) == GREEDY["max_tokens"]
        finally:
            await frontend.close()
        for refused_tls in (
            TlsConfig(ca_file=pki.ca),
            TlsConfig(pki.stranger.cert, pki.stranger.key, pki.ca),
        ):
            with pytest.raises(TimeoutError):
                await connect_frontend(scheduler.address, tokenizer, timeout_s=2, tls=refused_tls)
    finally:
        await scheduler.stop(0)
        await worker.stop(0)
