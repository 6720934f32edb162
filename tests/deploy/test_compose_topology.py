"""compose.yaml without Docker: each service's command runs as a local process on loopback
(service names become 127.0.0.1, ports are remapped to free ones, the tiny test model is
appended), and a generation goes through the whole worker -> scheduler -> frontend chain,
over gRPC and over the OpenAI HTTP API."""

from pathlib import Path

import pytest
import yaml

from pagestream import LLM, SamplingParams
from tests.helpers.processes import (
    grpc_token_ids,
    http_completion_text,
    local_compose,
    start_compose,
    stop,
)

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
PORTS = ("50061", "50062", "50051", "8000")
PROMPT = [5, 17, 33, 99, 250, 12, 8, 41]


def _extra_args(name: str) -> list[str]:
    return [] if name == "frontend" else ["--kv-cache-memory", "8MiB"]


def test_compose_services_as_local_processes(model_dir):
    model = model_dir("llama")
    compose = local_compose(COMPOSE, model, PORTS, _extra_args)
    assert set(compose.services) == {"worker", "scheduler", "frontend"}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(model), kv_cache_memory="8MiB")
    expected = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    processes = []
    try:
        start_compose(compose, processes)
        frontend = compose.services["frontend"].health_address
        assert grpc_token_ids(frontend, PROMPT, 6) == expected.token_ids
        assert http_completion_text(compose.ports["8000"], PROMPT, 6) == expected.text
        assert stop(processes) == [0] * len(processes)
    finally:
        stop(processes, timeout_s=10)


@pytest.mark.parametrize("service", ["worker", "scheduler", "frontend"])
def test_every_service_has_a_health_probe(service):
    spec = yaml.safe_load(COMPOSE.read_text())["services"][service]
    probe = " ".join(spec["healthcheck"]["test"])
    assert "HealthCheckRequest" in probe and spec["environment"]["HEALTH_PORT"]
