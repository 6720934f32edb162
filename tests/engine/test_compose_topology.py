"""compose.yaml without Docker: each service's command runs as a local process on loopback
(service names become 127.0.0.1, ports are remapped to free ones, the tiny test model is
appended), and a generation goes through the whole worker -> scheduler -> frontend chain,
over gRPC and over the OpenAI HTTP API."""

import json
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagestream import LLM, SamplingParams
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
PROMPT = [5, 17, 33, 99, 250, 12, 8, 41]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_commands(model: Path) -> dict[str, list[str]]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    ports = {p: str(_free_port()) for p in ("50061", "50062", "50051", "8000")}
    commands = {}
    for name, service in services.items():
        command = service["command"]
        for host in services:
            command = command.replace(f"{host}:", "127.0.0.1:")
        for old, new in ports.items():
            command = command.replace(old, new)
        argv = shlex.split(command.replace("0.0.0.0", "127.0.0.1"))
        assert argv[0] == "pagestream", argv
        extra = [] if name == "frontend" else ["--kv-cache-memory", "8MiB"]
        commands[name] = [sys.executable, "-m", "pagestream.cli", *argv[1:], str(model), *extra]
    return commands, ports


def _wait_serving(port: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert process.poll() is None, "a service exited before it was ready"
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"port {port} never became SERVING")


def test_compose_services_as_local_processes(model_dir):
    model = model_dir("llama")
    commands, ports = _local_commands(model)
    assert set(commands) == {"worker", "scheduler", "frontend"}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(model), kv_cache_memory="8MiB")
    expected = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    processes = []
    try:
        for name, health_port in (
            ("worker", "50061"),
            ("scheduler", "50062"),
            ("frontend", "50051"),
        ):
            processes.append(subprocess.Popen(commands[name]))
            _wait_serving(ports[health_port], processes[-1])
        with grpc.insecure_channel(f"127.0.0.1:{ports['50051']}") as channel:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(token_ids=PROMPT),
                sampling_params=pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            )
            stub = generation_pb2_grpc.GenerationStub(channel)
            responses = list(stub.Generate(request, timeout=60))
        assert [t for r in responses for t in r.token_ids] == expected.token_ids
        body = json.dumps(
            {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        ).encode()
        http = urllib.request.Request(
            f"http://127.0.0.1:{ports['8000']}/v1/completions",
            body,
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(http, timeout=60) as reply:
            completion = json.load(reply)
        assert completion["choices"][0]["text"] == expected.text
        for process in reversed(processes):
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.parametrize("service", ["worker", "scheduler", "frontend"])
def test_every_service_has_a_health_probe(service):
    spec = yaml.safe_load(COMPOSE.read_text())["services"][service]
    probe = " ".join(spec["healthcheck"]["test"])
    assert "HealthCheckRequest" in probe and spec["environment"]["HEALTH_PORT"]
