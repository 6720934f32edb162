"""compose.tp2.yaml without Docker: two tensor-parallel worker ranks that meet through the
torch.distributed environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), a scheduler that
drives both, and the frontend, each run as a local process on loopback (service names become
127.0.0.1, ports, MASTER_PORT included, are remapped to free ones, the tiny model is
appended). Greedy generations over gRPC and over the OpenAI HTTP API equal tp = 1."""

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

COMPOSE = Path(__file__).resolve().parents[2] / "compose.tp2.yaml"
PORTS = ("50061", "50063", "50062", "50051", "8000", "29500")
PROMPT = [5, 17, 33, 99, 250, 12, 8, 41]
MAX_TOKENS = 8
ENGINE = {"dtype": "float32", "kv_cache_memory": "8MiB"}


def _extra_args(name: str) -> list[str]:
    if name == "frontend":
        return []
    return ["--dtype", ENGINE["dtype"], "--kv-cache-memory", ENGINE["kv_cache_memory"]]


def _spec() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_the_file_describes_a_group_of_two_ranks():
    services = _spec()
    assert set(services) == {"worker-0", "worker-1", "scheduler", "frontend"}
    for rank in (0, 1):
        worker = services[f"worker-{rank}"]
        env = worker["environment"]
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), "2")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("worker-0", "29500")
        assert "-tp 2" in worker["command"]
        assert worker["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 1
        assert "HealthCheckRequest" in " ".join(worker["healthcheck"]["test"])
    scheduler = services["scheduler"]
    assert "--worker worker-0:50061 --worker worker-1:50063 -tp 2" in scheduler["command"]
    assert set(scheduler["depends_on"]) == {"worker-0", "worker-1"}


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(str(model_dir("llama")), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]


def test_compose_tp2_services_as_local_processes(model_dir, expected):
    compose = local_compose(COMPOSE, model_dir("llama"), PORTS, _extra_args)
    workers = [compose.services[f"worker-{rank}"] for rank in (0, 1)]
    assert [w.env["MASTER_ADDR"] for w in workers] == ["127.0.0.1"] * 2
    assert [w.env["MASTER_PORT"] for w in workers] == [compose.ports["29500"]] * 2
    assert [s.name for s in compose.stages()[0]] == ["worker-0", "worker-1"]
    processes = []
    try:
        start_compose(compose, processes)
        frontend = compose.services["frontend"].health_address
        assert grpc_token_ids(frontend, PROMPT, MAX_TOKENS) == expected.token_ids
        assert http_completion_text(compose.ports["8000"], PROMPT, MAX_TOKENS) == expected.text
        assert stop(processes) == [0] * len(processes)
    finally:
        stop(processes, timeout_s=10)
