"""The deployment as processes: `pagestream serve` (one process) and `--split-services`
(worker, scheduler and frontend as three processes over loopback gRPC), driven over the
public gRPC API; both answer what the in-process engine answers and stop cleanly on SIGTERM."""

import signal
import subprocess
import sys

import grpc
import pytest

from pagestream import LLM, SamplingParams
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from tests.helpers.processes import free_port, wait_serving

PROMPT = [5, 17, 33, 99, 250, 12, 8, 41]


def _generate(address: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(token_ids=PROMPT),
            sampling_params=pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        )
        responses = list(stub.Generate(request, timeout=60))
    assert responses[-1].usage.completion_tokens == 8
    return [t for r in responses for t in r.token_ids]


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(str(model_dir("llama")), kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize(
    "layout",
    [[], ["--single-process"], ["--split-services"]],
    ids=["engine-core-process", "single-process", "split-services"],
)
def test_serve_answers_like_the_engine_and_stops_on_sigterm(model_dir, expected, layout):
    grpc_port = free_port()
    command = [
        sys.executable,
        "-m",
        "pagestream.cli",
        "--log-level",
        "WARNING",
        "serve",
        str(model_dir("llama")),
        "--grpc-port",
        str(grpc_port),
        "--port",
        "-1",
        "--kv-cache-memory",
        "8MiB",
    ]
    process = subprocess.Popen([*command, *layout])
    try:
        wait_serving(f"127.0.0.1:{grpc_port}", [process])
        assert _generate(f"127.0.0.1:{grpc_port}") == expected.token_ids
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
