"""--distributed-executor-backend ray: on a local Ray instance, LLM(model,
tensor_parallel_size=2) gives the greedy outputs of tp = 1, and closing it leaves no
actor, worker process or placement group behind (and the caller's Ray running). A rank
that dies or a group Ray cannot place fails the start with a message saying so; without
Ray the flag fails with the command that installs it.

One Ray instance for the module, kept small (2 cores on the test machine)."""

import os
import subprocess
import sys

import pytest
import ray

from pagestream import LLM
from services.scheduler.launchers.launcher import WorkerStartError
from services.scheduler.launchers.ray_launcher import RayLauncher
from tests.engine.parallel_helpers import (
    assert_same_or_near_tie,
    generate_ids,
    greedy_params,
    mixed_prompts,
)
from tests.engine.process_helpers import free_port

ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def local_ray():
    """A one-node Ray started by `ray start` in its own small process: ray.init(address=
    "local") would fork the test process itself (Ray starts its servers with a preexec_fn,
    so no vfork), which fails with ENOMEM once the suite has made that process large."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}  # CI has no network to report to
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    port = free_port()
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    start = [
        *ray_cli, "start", "--head", f"--port={port}", "--num-cpus=4",
        f"--object-store-memory={100 * 1024 * 1024}", "--include-dashboard=false",
        "--disable-usage-stats",
    ]  # fmt: skip
    subprocess.run(start, env=env, check=True, timeout=180, capture_output=True)
    try:
        ray.init(address="auto", log_to_driver=True)  # the cluster just started here
        yield ray
    finally:
        ray.shutdown()
        subprocess.run([*ray_cli, "stop", "--force"], env=env, timeout=120, capture_output=True)


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir("llama")


@pytest.fixture(scope="module")
def tp2(local_ray, folder):
    llm = LLM(
        str(folder),
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        kv_cache_memory="8MiB",
        **ENGINE,
    )
    yield llm
    llm.engine.close()


def test_tp2_on_ray_matches_one_worker(tp2, folder):
    info = tp2.engine.model_info
    assert (info.world_size, info.tensor_parallel_size) == (2, 2)
    prompts = [p[:20] for p in mixed_prompts(3, seed=7)]
    params = greedy_params(len(prompts), max_tokens=5)
    got = generate_ids(tp2, prompts, params)
    tp1 = LLM(str(folder), kv_cache_memory="8MiB", **ENGINE)
    try:
        reference = generate_ids(tp1, prompts, params)
    finally:
        tp1.engine.close()
    for prompt, out, ref in zip(prompts, got, reference, strict=True):
        assert len(out) >= 5
        assert_same_or_near_tie(folder, prompt, out, ref)


def test_ranks_run_in_ray_actors_on_their_node(tp2):
    group = tp2.engine.executor.launcher
    assert len(group.actors) == 2
    assert all(place.pid > 0 and place.pid != os.getpid() for place in group.places)
    node_ip = ray.util.get_node_ip_address()
    assert [place.ip for place in group.places] == [node_ip, node_ip]
    # Two ranks on one node share its cores (as mp does), unless the caller chose.
    share = os.environ.get("OMP_NUM_THREADS") or str(max(1, group.places[0].cpus // 2))
    for place in group.places:
        assert _environ(place.pid)["OMP_NUM_THREADS"] == share


def test_close_removes_actors_processes_and_placement_group(local_ray, folder):
    llm = LLM(
        str(folder),
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        kv_cache_memory="8MiB",
        **ENGINE,
    )
    group = llm.engine.executor.launcher
    actors, pids, pg = list(group.actors), group.pids, group.placement_group
    assert ray.util.placement_group_table(pg)["state"] == "CREATED"
    llm.engine.close()
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.exit_code.remote(), timeout=30)
    for pid in pids:
        assert not _alive(pid), f"worker process {pid} outlived close()"
    assert ray.is_initialized()  # the caller's Ray is left running


def test_a_rank_that_exits_fails_the_start_and_frees_its_place(local_ray):
    def command(rank, rendezvous, host, ready_file):
        return ["-c", "import sys; sys.exit(3)"]  # dies before writing its ready file

    placed = _created_placement_groups()
    group = RayLauncher(2, command, device="cpu")
    with pytest.raises(WorkerStartError, match="rank 0 on Ray: the worker process exited with 3"):
        group.start(timeout_s=60)
    assert group.actors == [] and _created_placement_groups() == placed
    assert ray.is_initialized()


def test_a_group_ray_cannot_place_fails_with_the_cluster_resources(local_ray):
    ranks = int(ray.cluster_resources().get("GPU", 0)) + 1  # one GPU more than there are
    group = RayLauncher(ranks, lambda *_: ["-c", "pass"], device="cuda")
    with pytest.raises(WorkerStartError, match=rf"could not place {ranks} bundles of \{{'GPU': 1"):
        group.start(timeout_s=2)
    assert group.placement_group is None


def test_missing_ray_names_the_install_command(monkeypatch, folder):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'pagestream\[ray\]'"):
        LLM(
            str(folder),
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            kv_cache_memory="8MiB",
            **ENGINE,
        )


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().decode().split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _created_placement_groups() -> set[str]:
    return {
        pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] == "CREATED"
    }
