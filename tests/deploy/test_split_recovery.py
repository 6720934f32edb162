"""`pagestream serve --split-services` recovers by itself: SIGKILL the worker, then the
scheduler, each while a stream is in flight; every stream ends with UNAVAILABLE (not by its
deadline), readiness (/ready, gRPC health) goes false, the supervisor restarts the dead role,
the survivors reconnect, and requests succeed with the outputs of before; /health (liveness)
stays 200 throughout."""

from __future__ import annotations

import threading

import grpc
import pytest

from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from tests.helpers.eventually import eventually
from tests.helpers.processes import (
    POLL_S,
    alive,
    cli,
    cmdline,
    descendants,
    free_port,
    grpc_token_ids,
    http_status,
    kill_pids,
    serving,
)

PROMPT = [5, 17, 33, 99, 250, 12, 8, 41]
STREAM_DEADLINE_S = 120


def _role_pid(serve_pid: int, role: str) -> int:
    pids = [p for p in descendants(serve_pid) if role in cmdline(p)[3:6]]
    assert len(pids) == 1, (role, [cmdline(p) for p in descendants(serve_pid)])
    return pids[0]


def _stream_until_error(grpc_port: int, result: dict) -> None:
    """A long gRPC stream in a thread; records that it streamed and how it ended."""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(token_ids=PROMPT),
            sampling_params=pb.SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True),
        )
        try:
            for _ in stub.Generate(request, timeout=STREAM_DEADLINE_S):
                result["streaming"] = True
            result["code"] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            result["code"] = exc.code()


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

    def streaming() -> bool:
        assert "code" not in result, result  # it ended before the kill
        return result.get("streaming", False)

    eventually(streaming, "the long stream streaming")
    victim = _role_pid(process.pid, role)
    kill_pids([victim])
    stream.join(timeout=STREAM_DEADLINE_S + 30)
    assert not stream.is_alive(), "the stream did not end"
    # UNAVAILABLE, not DEADLINE_EXCEEDED: the loss ended the stream, it did not hang on
    assert result["code"] == grpc.StatusCode.UNAVAILABLE, result
    eventually(lambda: http_status(http_port, "/ready") == 503, "/ready 503", interval=POLL_S)
    assert http_status(http_port, "/health") == 200  # liveness: the frontend is up
    assert not alive(victim)
    eventually(lambda: http_status(http_port, "/ready") == 200, "/ready 200 again", interval=POLL_S)
    assert _role_pid(process.pid, role) != victim  # the supervisor started a new one
    assert grpc_token_ids(f"127.0.0.1:{grpc_port}", PROMPT, 8) == expected
    assert process.poll() is None
