"""compose.dp2.yaml without Docker: two data-parallel replicas (worker-a + scheduler-a,
worker-b + scheduler-b) behind one frontend that routes between its two schedulers, each
run as a local process on loopback (service names become 127.0.0.1, ports are remapped to
free ones, the tiny model is appended). Greedy generations over gRPC and over the OpenAI
HTTP API equal one engine's, and both replicas take requests."""

from pathlib import Path

import grpc
import pytest
import yaml

from pagestream import LLM, SamplingParams
from services.common.proto.pagestream.internal.v1 import engine_pb2, engine_pb2_grpc
from tests.helpers.processes import (
    grpc_token_ids,
    http_completion_text,
    local_compose,
    start_compose,
    stop,
)

COMPOSE = Path(__file__).resolve().parents[2] / "compose.dp2.yaml"
PORTS = ("50061", "50063", "50062", "50064", "50051", "8000")
# Distinct prompts (no shared prefix), each longer than one 16-token block, so the
# cache-aware router sees them as misses everywhere and spreads them by load and cache.
PROMPTS = [[(7 * i + 3 * j + 5) % 500 + 3 for j in range(20)] for i in range(12)]
MAX_TOKENS = 8
ENGINE = {"dtype": "float32", "kv_cache_memory": "8MiB"}
REPLICAS = {"a": ("worker-a", "scheduler-a"), "b": ("worker-b", "scheduler-b")}


def _extra_args(name: str) -> list[str]:
    if name == "frontend":
        return []
    return ["--dtype", ENGINE["dtype"], "--kv-cache-memory", ENGINE["kv_cache_memory"]]


def _spec() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_the_file_describes_two_replicas_behind_one_frontend():
    services = _spec()
    assert set(services) == {"worker-a", "scheduler-a", "worker-b", "scheduler-b", "frontend"}
    ports = {"a": ("50061", "50062"), "b": ("50063", "50064")}
    for replica, (worker_name, scheduler_name) in REPLICAS.items():
        worker_port, scheduler_port = ports[replica]
        worker, scheduler = services[worker_name], services[scheduler_name]
        assert worker["command"] == f"pagestream worker --host 0.0.0.0 --port {worker_port}"
        assert worker["environment"]["HEALTH_PORT"] == worker_port
        assert "RANK" not in worker["environment"]  # a group of one: no rendezvous
        assert worker["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 1
        assert f"--worker {worker_name}:{worker_port} " in scheduler["command"]
        assert scheduler["command"].count("--worker") == 1  # one scheduler owns one worker
        assert f"--port {scheduler_port}" in scheduler["command"]
        assert scheduler["environment"]["HEALTH_PORT"] == scheduler_port
        assert set(scheduler["depends_on"]) == {worker_name}
        for service in (worker, scheduler):
            assert "HealthCheckRequest" in " ".join(service["healthcheck"]["test"])
            assert service["volumes"] == ["model-cache:/opt/pagestream/cache"]
    frontend = services["frontend"]
    assert (
        "--scheduler scheduler-a:50062 --scheduler scheduler-b:50064 --router-policy cache_aware"
        in frontend["command"]
    )
    assert set(frontend["depends_on"]) == {"scheduler-a", "scheduler-b"}
    assert frontend["ports"] == ["50051:50051", "8000:8000"]


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(str(model_dir("llama")), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [r.outputs[0] for r in llm.generate(prompts, params, use_tqdm=False)]


def _prefix_cache_queries(address: str) -> int:
    """Prompt tokens the scheduler at address has looked up in its prefix cache: > 0 once
    it has scheduled a request."""
    with grpc.insecure_channel(address) as channel:
        stats = engine_pb2_grpc.EngineCoreStub(channel).GetStats(
            engine_pb2.GetStatsRequest(), timeout=10
        )
    return stats.prefix_cache_queries


def test_compose_dp2_services_as_local_processes(model_dir, expected):
    compose = local_compose(COMPOSE, model_dir("llama"), PORTS, _extra_args)
    stages = [sorted(s.name for s in stage) for stage in compose.stages()]
    assert stages == [["worker-a", "worker-b"], ["scheduler-a", "scheduler-b"], ["frontend"]]
    schedulers = [compose.services[s].health_address for _, s in REPLICAS.values()]
    processes = []
    try:
        start_compose(compose, processes)
        frontend = compose.services["frontend"].health_address
        assert [_prefix_cache_queries(s) for s in schedulers] == [0, 0]
        text = http_completion_text(compose.ports["8000"], PROMPTS[0], MAX_TOKENS)
        assert text == expected[0].text
        served = []
        for prompt, out in zip(PROMPTS, expected, strict=True):
            assert grpc_token_ids(frontend, prompt, MAX_TOKENS) == out.token_ids
            served = [_prefix_cache_queries(s) for s in schedulers]
        # Every prompt went to one replica or the other, and each replica took some.
        assert all(n > 0 for n in served), f"prefix-cache lookups per scheduler: {served}"
        assert stop(processes) == [0] * len(processes)
    finally:
        stop(processes, timeout_s=10)
