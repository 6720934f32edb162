"""Which CPUs a process may compute on: CPU lists, physical cores, per-rank shares.

No torch here: the mp launcher (in the scheduler process) splits the cores between the
worker ranks it starts and hands each its share on the command line (`--cpu-cores`); the
worker confines itself to it (its affinity mask), and pins its intra-op threads within the
mask (services/worker/cpu_tuning.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def parse_cpu_list(text: str) -> list[int]:
    """ "0,2,4-7" -> [0, 2, 4, 5, 6, 7] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        try:
            cpus += range(int(first), int(last or first) + 1)
        except ValueError:
            raise ValueError(f"a CPU list (--cpu-cores) looks like 0-3,8; got {text!r}") from None
    return cpus


SYSFS_CPUS = Path("/sys/devices/system/cpu")


def one_per_core(cpus: list[int], sysfs: Path = SYSFS_CPUS) -> list[int]:
    """The first logical CPU of each physical core among `cpus` (SMT siblings share a
    core's units: two compute threads on one core run slower than one)."""
    seen: set[tuple[str, str]] = set()
    chosen = []
    for cpu in sorted(cpus):
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            core = (
                (topology / "physical_package_id").read_text().strip(),
                (topology / "core_id").read_text().strip(),
            )
        except OSError:
            core = ("cpu", str(cpu))  # no topology: every CPU its own core
        if core not in seen:
            seen.add(core)
            chosen.append(cpu)
    return chosen


def allowed_cpus() -> list[int]:
    """This process's affinity mask, sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def confine_to(cpu_list: str | None) -> None:
    """Limit this process to the CPUs of `cpu_list` (a rank's share; None: no change). Set
    before the compute threads start: threads inherit the mask of the one that starts them."""
    if cpu_list and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, parse_cpu_list(cpu_list))


def rank_shares(world_size: int, per_rank: int) -> list[list[int]]:
    """Disjoint CPU lists for `world_size` local ranks of `per_rank` physical cores each
    (one logical CPU per core), or [] when the machine has too few cores to split."""
    cores = one_per_core(allowed_cpus())
    if per_rank < 1 or per_rank * world_size > len(cores):
        return []
    return [cores[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]


def format_cpu_list(cpus: list[int]) -> str:
    return ",".join(str(cpu) for cpu in cpus)
