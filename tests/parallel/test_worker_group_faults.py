"""A worker group started by someone else (the `external` backend: `pagestream worker
-tp 2 --rank R --dist-init-method ...` processes) fails whole and comes back whole:
killing one rank mid-step fails the step (a ConnectionError naming a rank and its address,
not the step's result timeout), the
surviving rank exits too (its process group cannot be mended), and the group restarted
on the same addresses serves the same tokens to a reconnected executor."""

import signal
import subprocess
import sys

import pytest

from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import NewRequestData, SchedulerOutput
from services.scheduler.executor.worker_group import WorkerGroupExecutor
from tests.helpers.processes import free_port

PROMPT = [5, 17, 33, 99, 250, 12, 8, 41]


def _worker_argv(model: str, rank: int, port: int, rendezvous: str) -> list[str]:
    role = ["worker", model, "--port", str(port), "-tp", "2", "--rank", str(rank)]
    group = ["--dist-init-method", rendezvous, "--dist-timeout", "60"]
    cache = ["--kv-cache-memory", "1MiB", "--swap-space", "0.01"]
    return [sys.executable, "-m", "pagestream.cli", "--log-level", "WARNING", *role, *group, *cache]


def _start_group(model: str, ports: list[int], rendezvous: str) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(_worker_argv(model, rank, port, rendezvous))
        for rank, port in enumerate(ports)
    ]


def _prefill_plan(request_id: str) -> SchedulerOutput:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    new = NewRequestData(request_id, PROMPT, [], params, ([0],), 0)
    return SchedulerOutput(
        scheduled_new_reqs=[new],
        num_scheduled_tokens={request_id: len(PROMPT)},
        total_num_scheduled_tokens=len(PROMPT),
    )


def _first_token(executor: WorkerGroupExecutor, request_id: str) -> int:
    # a step that hung would raise TimeoutError here, which is no ConnectionError
    result = executor.execute(_prefill_plan(request_id)).result(timeout=60)
    return result.sampled_token_ids[0][0]


def _connect(addresses: list[str]) -> WorkerGroupExecutor:
    executor = WorkerGroupExecutor(addresses, tensor_parallel_size=2)
    executor.wait_until_ready(120)
    executor.initialize_cache(256, 4, 64)
    return executor


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def test_a_killed_rank_fails_the_group_and_the_restarted_group_serves(
    model_dir, tmp_path, processes
):
    model = str(model_dir("llama"))
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{port}" for port in ports]
    group = _start_group(model, ports, f"file://{tmp_path}/rendezvous-0")
    processes += group
    executor = _connect(addresses)
    try:
        expected = _first_token(executor, "a")
        group[1].send_signal(signal.SIGKILL)
        with pytest.raises(ConnectionError, match=r"rank \d at 127\.0\.0\.1:\d+"):
            _first_token(executor, "b")
        group[0].wait(timeout=30)  # the survivor leaves: its process group is broken
        assert group[0].returncode != 0
    finally:
        executor.close()
    group = _start_group(model, ports, f"file://{tmp_path}/rendezvous-1")
    processes += group
    executor = _connect(addresses)
    try:
        assert _first_token(executor, "c") == expected
    finally:
        executor.close()
