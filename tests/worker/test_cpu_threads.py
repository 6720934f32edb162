"""CPU lists, one thread per physical core, per-rank shares, and pinning torch's threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.cpu_cores import (
    format_cpu_list,
    one_per_core,
    parse_cpu_list,
    rank_shares,
)

REPO = Path(__file__).resolve().parents[2]


def test_cpu_lists_parse_like_the_kernels_cpulist():
    assert parse_cpu_list("0,2,4-6") == [0, 2, 4, 5, 6]
    assert parse_cpu_list(" 3 ") == [3]
    assert format_cpu_list([0, 2, 5]) == "0,2,5"
    with pytest.raises(ValueError, match="--cpu-cores"):
        parse_cpu_list("0-x")


def _fake_topology(root: Path, cores: dict[int, tuple[int, int]]) -> Path:
    for cpu, (package, core) in cores.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "physical_package_id").write_text(f"{package}\n")
        (folder / "core_id").write_text(f"{core}\n")
    return root


def test_smt_siblings_count_once(tmp_path):
    # cpus 0/4 and 1/5 are hyper-threads of cores 0 and 1; cpu 2 is core 0 of package 1
    sysfs = _fake_topology(tmp_path, {0: (0, 0), 4: (0, 0), 1: (0, 1), 5: (0, 1), 2: (1, 0)})
    assert one_per_core([5, 4, 2, 1, 0], sysfs) == [0, 1, 2]
    assert one_per_core([7], sysfs) == [7]  # no topology: its own core


def test_rank_shares_are_disjoint_or_nothing(monkeypatch):
    monkeypatch.setattr("services.common.cpu_cores.allowed_cpus", lambda: list(range(8)))
    monkeypatch.setattr("services.common.cpu_cores.SYSFS_CPUS", Path("/nonexistent"))
    assert rank_shares(2, 3) == [[0, 1, 2], [3, 4, 5]]
    assert rank_shares(3, 3) == []  # 9 cores asked of 8: no shares, no pinning
    assert rank_shares(2, 0) == []


PROBE = """
import json, os, torch
from services.common.cpu_cores import confine_to
from services.worker.cpu_tuning import pin_threads
confine_to(os.environ.get("CPUS"))  # as a worker given --cpu-cores does first
torch.set_num_threads(int(os.environ["THREADS"]))
cpus = pin_threads(os.environ.get("BIND", "auto"))
torch.ones(4096, 4096).sum()  # the pinned team runs this
print(json.dumps({"cpus": cpus, "threads": torch.get_num_threads(),
                  "main": sorted(os.sched_getaffinity(0))}))
"""


def _probe(**env: str) -> dict:
    full = {**os.environ, **env, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread pinning is Linux-only")
def test_pinning_puts_the_calling_thread_on_its_cpu():
    cpu = min(os.sched_getaffinity(0))
    got = _probe(CPUS=str(cpu), THREADS="1")
    assert got == {"cpus": [cpu], "threads": 1, "main": [cpu]}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread pinning is Linux-only")
def test_no_pinning_when_the_threads_leave_cores_free_or_when_bind_is_none():
    cores = len(os.sched_getaffinity(0))
    if cores > 1:  # fewer threads than cores: another process may use the rest
        got = _probe(THREADS="1")
        assert got["cpus"] == [] and len(got["main"]) == cores
    got = _probe(BIND="none", THREADS=str(cores))  # threads that fill the mask: auto pins
    assert got["cpus"] == [] and len(got["main"]) == cores
