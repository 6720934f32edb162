"""Servers over the in-process engine: the OpenAI HTTP server (one per module, its tests
leave it idle; `server_model` and SERVER_ARGS choose what it serves) and the public gRPC
server over the test's own `engine` (with a channel and a Generation stub to it)."""

import grpc
import pytest
import pytest_asyncio

from services.common.proto.pagestream.v1 import generation_pb2_grpc
from services.frontend.frontend_server import serve_frontend
from tests.helpers.openai_server import running_server


@pytest.fixture(scope="module")
def server_model(model_dir):
    """The folder `server` serves (a module overrides it for another model)."""
    return model_dir("llama")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(server_model, request):
    """The OpenAI server over an in-process engine, one per module; a module passes other
    running_server arguments as SERVER_ARGS (a dict)."""
    async with running_server(server_model, **getattr(request.module, "SERVER_ARGS", {})) as s:
        yield s


@pytest.fixture
async def grpc_server(engine):
    handle = await serve_frontend(engine.frontend, "127.0.0.1", 0)
    yield handle
    await handle.stop(grace=None)


@pytest.fixture
async def channel(grpc_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_server.port}") as channel:
        yield channel


@pytest.fixture
def stub(channel):
    return generation_pb2_grpc.GenerationStub(channel)
