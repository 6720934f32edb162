"""What a client sees of a quantized model: GetModelInfo over gRPC and /metrics name the
formats that run and the resident weight bytes (a tiny Llama as a Q4_1 GGUF file, served
in process with its blocks kept); a float model says "none"."""

from __future__ import annotations

import grpc
import pytest

from pagestream import AsyncEngine
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from services.frontend.frontend_server import serve_frontend
from tests.helpers.openai_server import running_server
from tests.helpers.tiny_gguf import tiny_gguf_file

TIMEOUT = 30


@pytest.fixture
def q4_1_file(tmp_path, monkeypatch):
    return tiny_gguf_file(tmp_path, monkeypatch, "Q4_1")


async def test_get_model_info_names_the_quantization(q4_1_file):
    engine = AsyncEngine.from_args(
        str(q4_1_file), engine_core_process=False, kv_cache_memory="8MiB"
    )
    handle = await serve_frontend(engine.frontend, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    finally:
        await handle.stop(grace=None)
        await engine.shutdown()
    assert info.quantization == "Q4_1"  # every matrix, the tied embedding included
    assert 0 < info.weight_bytes < 1_000_000  # codes and scales of a 300 x 64 model


async def test_metrics_report_the_quantization_and_weight_bytes(q4_1_file, model_dir):
    async with running_server(q4_1_file) as server:
        quantized = await server.metrics()
    async with running_server(model_dir("llama")) as server:
        floats = await server.metrics()
    (info,) = [k for k in quantized if k.startswith("pagestream:model_info")]
    assert 'quantization="Q4_1"' in info and quantized[info] == 1
    (float_info,) = [k for k in floats if k.startswith("pagestream:model_info")]
    assert 'quantization="none"' in float_info
    assert 0 < quantized["pagestream:model_weight_bytes"] < floats["pagestream:model_weight_bytes"]
