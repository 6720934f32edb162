"""`pagestream serve --split-services` recovers by itself: SIGKILL the worker, then the
scheduler, each while a stream is in flight; every stream ends with an error within 5 s,
readiness (/ready, gRPC health) goes false, the supervisor restarts the dead role, the
survivors reconnect, and within 30 s requests succeed with the outputs of before; /health
(liveness) stays 200 throughout."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from tests.helpers.processes import (
    alive,
    cli,
    cmdline,
    descendants,
    free_port,
    grpc_token_ids,
    http_status,
    kill_pids,
    serving,
    wait_http,
)

PROMPT = [5, 17, 33, 99, 250, 12, 8, 41]
RECOVERY_S = 30


def _role_pid(serve_pid: int, role: str) -> int:
    pids = [p for p in descendants(serve_pid) if role in cmdline(p)[3:6]]
    assert len(pids) == 1, (role, [cmdline(p) for p in descendants(serve_pid)])
    return pids[0]


def _stream_until_error(grpc_port: int, result: dict) -> None:
    """A long gRPC stream in a thread; records how it ended and when."""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(token_ids=PROMPT),
            sampling_params=pb.SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True),
        )
        try:
            for _ in stub.Generate(request, timeout=120):
                result.setdefault("first", time.monotonic())
            result["code"] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            result["code"] = exc.code()
        result["ended"] = time.monotonic()


@pytest.fixture(scope="module")
def served(model_dir):
    grpc_port, http_port = free_port(), free_port()
    argv = cli(
        "--log-level", "WARNING", "serve", str(model_dir("llama")), "--split-services",
        "--grpc-port", str(grpc_port), "--port", str(http_port),
        "--kv-cache-memory", "8MiB", "--swap-space", "0.01",
    )  # fmt: skip
    with serving(argv, grpc_port, http_port) as process:
        yield process, grpc_port, http_port


@pytest.mark.parametrize("role", ["worker", "scheduler"])
def test_a_killed_role_is_restarted_and_the_deployment_recovers(served, role):
    process, grpc_port, http_port = served
    expected = grpc_token_ids(f"127.0.0.1:{grpc_port}", PROMPT, 8)
    result: dict = {}
    stream = threading.Thread(target=_stream_until_error, args=(grpc_port, result))
    stream.start()
    deadline = time.monotonic() + 30
    while "first" not in result:
        assert time.monotonic() < deadline and stream.is_alive(), result
        time.sleep(0.05)
    victim = _role_pid(process.pid, role)
    killed_at = time.monotonic()
    kill_pids([victim])
    stream.join(timeout=10)
    assert not stream.is_alive(), "the stream did not end"
    assert result["code"] == grpc.StatusCode.UNAVAILABLE, result
    assert result["ended"] - killed_at < 5
    wait_http(http_port, "/ready", 503, 5)
    assert http_status(http_port, "/health") == 200  # liveness: the frontend is up
    assert not alive(victim)
    wait_http(http_port, "/ready", 200, RECOVERY_S)
    assert _role_pid(process.pid, role) != victim  # the supervisor started a new one
    assert grpc_token_ids(f"127.0.0.1:{grpc_port}", PROMPT, 8) == expected
    assert process.poll() is None
