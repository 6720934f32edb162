"""compose.tls.yaml without Docker: the worker, the scheduler and the frontend started from
the file's commands as local processes with certificates made in the test (mutual TLS on
the worker and the scheduler, TLS on the public port); the file's own health-check logic
(TLS with the role's certificate) sees every role SERVING, and a generation over the TLS
public port equals the in-process engine's."""

import os
import shlex
import subprocess
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagestream import LLM, SamplingParams
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from tests.common.certs import make_ca, make_leaf
from tests.helpers.eventually import eventually
from tests.helpers.processes import START_TIMEOUT_S, cli, free_port, stop

COMPOSE = Path(__file__).resolve().parents[2] / "compose.tls.yaml"
PROMPT = [5, 17, 33, 99, 250, 12, 8, 41]
ROLES = ("worker", "scheduler", "frontend")


def _pki(folder: Path) -> None:
    """ca.pem plus ROLE.pem / ROLE.key, named as the compose file expects."""
    ca, ca_key = make_ca(folder, "ca-cert")
    (folder / "ca.pem").write_bytes(Path(ca.cert).read_bytes())
    for role in ROLES:
        leaf = make_leaf(folder, role, "ca-cert", ca_key)
        assert Path(leaf.cert) == folder / f"{role}.pem"


def _credentials(folder: Path, role: str) -> grpc.ChannelCredentials:
    read = lambda name: (folder / name).read_bytes()  # noqa: E731
    return grpc.ssl_channel_credentials(read("ca.pem"), read(f"{role}.key"), read(f"{role}.pem"))


def _wait_tls_serving(port: str, folder: Path, role: str, processes) -> None:
    """The compose file's health check: Check over TLS with the role's own certificate."""
    with grpc.secure_channel(f"localhost:{port}", _credentials(folder, role)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            assert all(p.poll() is None for p in processes), "a role exited"
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        eventually(serving, f"{role} SERVING over TLS", timeout=START_TIMEOUT_S, interval=0.2)


def _local_argv(command: str, folder: Path, ports: dict[str, str], model: Path) -> list[str]:
    for host in ROLES:
        command = command.replace(f"{host}:", "localhost:")
    for old, new in ports.items():
        command = command.replace(old, new)
    command = command.replace("/certs/", f"{folder}/").replace("0.0.0.0", "127.0.0.1")
    argv = shlex.split(command)
    extra = [] if argv[1] == "frontend" else ["--kv-cache-memory", "8MiB", "--dtype", "float32"]
    return [*cli(*argv[1:]), str(model), *extra]


def test_the_tls_deployment_serves_over_tls(model_dir, tmp_path):
    _pki(tmp_path)
    model = model_dir("llama")
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    ports = {p: str(free_port()) for p in ("50061", "50062", "50051", "8000")}
    processes: list[subprocess.Popen] = []
    try:
        for role in ROLES:
            argv = _local_argv(services[role]["command"], tmp_path, ports, model)
            processes.append(subprocess.Popen(argv, env=dict(os.environ)))
            port = services[role]["environment"]["HEALTH_PORT"]
            _wait_tls_serving(ports[port], tmp_path, role, processes)
        ca = (tmp_path / "ca.pem").read_bytes()
        address = f"localhost:{ports['50051']}"
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)) as channel:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(token_ids=PROMPT),
                sampling_params=pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            )
            replies = list(
                generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
            )
        got = [t for r in replies for t in r.token_ids]
    finally:
        stop(processes)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(model), dtype="float32", kv_cache_memory="8MiB")
    expected = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert got == expected.outputs[0].token_ids
