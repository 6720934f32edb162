"""`pagestream serve --data-parallel-size 2`, the one command for two replicas: two worker
+ scheduler pairs and one routing frontend as supervised processes. Greedy outputs equal
one offline engine's, both replicas take requests (the router's per-engine metrics say
so), and killing one replica's worker leaves the deployment ready and serving."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagestream import LLM, SamplingParams
from tests.helpers.processes import (
    cli,
    cmdline,
    descendants,
    free_port,
    grpc_token_ids,
    http_status,
    kill_pids,
    serving,
)

PROMPTS = [[5 + i, 17, 33, 99, 250, 12, 8, 41 + i] for i in range(6)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(model_dir):
    grpc_port, http_port = free_port(), free_port()
    argv = cli(
        "--log-level", "WARNING", "serve", str(model_dir("llama")), "-dp", "2",
        "--grpc-port", str(grpc_port), "--port", str(http_port),
        "--kv-cache-memory", "8MiB", "--swap-space", "0.01", "--dtype", "float32",
    )  # fmt: skip
    with serving(argv, grpc_port, http_port) as process:
        yield process, grpc_port, http_port


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(str(model_dir("llama")), dtype="float32", kv_cache_memory="8MiB")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def _routed(samples: dict[str, float], engine: str) -> float:
    prefix = f'pagestream:router_requests_total{{engine="{engine}"'
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def test_two_replicas_serve_with_the_same_outputs(served, expected):
    _process, grpc_port, http_port = served
    address = f"127.0.0.1:{grpc_port}"
    assert [grpc_token_ids(address, p, MAX_TOKENS) for p in PROMPTS] == expected
    samples = _metrics(http_port)
    assert _routed(samples, "0") > 0 and _routed(samples, "1") > 0, samples
    assert _routed(samples, "0") + _routed(samples, "1") == len(PROMPTS)
    for engine in ("0", "1"):
        assert f'pagestream:num_requests_running{{engine="{engine}"}}' in samples
        assert samples[f'pagestream:prefix_cache_queries_total{{engine="{engine}"}}'] > 0


def test_a_dead_replica_worker_leaves_the_deployment_serving(served, expected):
    process, grpc_port, http_port = served
    workers = [p for p in descendants(process.pid) if "worker" in cmdline(p)[3:6]]
    assert len(workers) == 2, [cmdline(p) for p in descendants(process.pid)]
    kill_pids(workers[:1])
    address = f"127.0.0.1:{grpc_port}"
    for prompt, tokens in zip(PROMPTS, expected, strict=True):  # the other replica serves
        assert grpc_token_ids(address, prompt, MAX_TOKENS) == tokens
        assert http_status(http_port, "/ready") == 200
    assert process.poll() is None
