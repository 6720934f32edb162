"""`pagestream worker | scheduler | frontend` as separate processes: SIGKILL the scheduler
mid-stream, and the frontend process (never restarted) ends the stream with UNAVAILABLE
(not by its deadline), reports not ready (gRPC health, HTTP /ready 503) but alive (/health
200), refuses requests (UNAVAILABLE, while no scheduler is there: nothing waits for one),
and serves the same greedy outputs once a new scheduler process starts on the same port."""

from __future__ import annotations

import os
import signal
import subprocess

import grpc
import pytest

from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from tests.helpers.eventually import eventually
from tests.helpers.processes import (
    NOT_SERVING,
    POLL_S,
    SERVING,
    cli,
    free_port,
    grpc_token_ids,
    health_status,
    http_status,
    stop,
    wait_serving,
)

PROMPT_IDS = [5, 17, 33, 99, 250, 12, 8, 41]


@pytest.fixture
def roles(model_dir, tmp_path):
    folder = str(model_dir("llama"))
    ports = {name: free_port() for name in ("worker", "scheduler", "grpc", "http")}
    engine = ["--kv-cache-memory", "8MiB", "--swap-space", "0.01", "--device", "cpu"]
    worker, scheduler = f"127.0.0.1:{ports['worker']}", f"127.0.0.1:{ports['scheduler']}"
    port = str(ports["scheduler"])
    public = ["--grpc-port", str(ports["grpc"]), "--port", str(ports["http"])]
    commands = {
        "worker": cli("worker", folder, "--port", str(ports["worker"]), *engine),
        "scheduler": cli("scheduler", folder, "--worker", worker, "--port", port, *engine),
        "frontend": cli("frontend", folder, "--scheduler", scheduler, *public),
    }
    logs = tmp_path / "logs"
    logs.mkdir()
    processes: dict[str, subprocess.Popen] = {}

    def start(name: str) -> subprocess.Popen:
        log = open(logs / f"{name}.log", "ab")  # noqa: SIM115 (the process owns it)
        processes[name] = subprocess.Popen(commands[name], stdout=log, stderr=subprocess.STDOUT)
        return processes[name]

    try:
        for name in ("worker", "scheduler", "frontend"):
            start(name)
        wait_serving(f"127.0.0.1:{ports['grpc']}", processes.values())
        yield ports, processes, start
    finally:
        stop(list(processes.values()))


def test_a_killed_scheduler_process_is_recovered_from_without_restarting_the_frontend(roles):
    ports, processes, start = roles
    public = f"127.0.0.1:{ports['grpc']}"
    before = grpc_token_ids(public, PROMPT_IDS, 6)
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(token_ids=PROMPT_IDS),
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
    )
    with grpc.insecure_channel(public) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
        next(call)  # streaming
        os.kill(processes["scheduler"].pid, signal.SIGKILL)
        processes["scheduler"].wait()
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:
                pass
        # UNAVAILABLE, not DEADLINE_EXCEEDED: the loss ended the stream, it did not hang on
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE

    eventually(
        lambda: health_status(public) == NOT_SERVING, "frontend health NOT_SERVING", interval=POLL_S
    )
    assert http_status(ports["http"], "/ready") == 503
    assert http_status(ports["http"], "/health") == 200
    with pytest.raises(grpc.RpcError) as refused:
        grpc_token_ids(public, PROMPT_IDS, 6)
    # refused, not held until a scheduler is back (that would be OK or DEADLINE_EXCEEDED)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    start("scheduler")
    eventually(
        lambda: health_status(public) == SERVING, "frontend health SERVING again", interval=POLL_S
    )
    assert http_status(ports["http"], "/ready") == 200
    assert grpc_token_ids(public, PROMPT_IDS, 6) == before
    assert processes["frontend"].poll() is None
