"""MpLauncher: the `mp` backend: tp * pp local Worker processes, under a Supervisor.

Each rank is a `pagestream worker` process (the command comes from the caller, who knows
the CLI) that binds a free loopback port and writes its address to a ready file; the ranks
meet through a file rendezvous in a private temporary folder (no race for ports). The
launcher never restarts a rank: a lost rank is the engine core's to rebuild, as a new group.
On the CPU each rank gets an equal share of the cores: OMP_NUM_THREADS (unless the caller
set it) and, where the machine has enough, cores of its own on its command line.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from services.common.cpu_cores import format_cpu_list, rank_shares
from services.common.supervisor import Child, ChildExited, Supervisor
from services.scheduler.launchers.launcher import PARENT_PID_ENV, WorkerStartError

logger = logging.getLogger(__name__)

# rank, rendezvous (file://...), ready file, its cores (a CPU list, or None: the machine's)
# -> argv of that rank's worker process
WorkerCommand = Callable[[int, str, Path, str | None], list[str]]
RANKS = "ranks"  # one restart group: a process group cannot outlive a member


class MpLauncher:
    def __init__(self, world_size: int, command: WorkerCommand, threads_per_rank: int = 0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        self.world_size = world_size
        self.command = command
        self.threads_per_rank = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self.folder = Path(tempfile.mkdtemp(prefix="pagestream-mp-"))
        # Never restarts a rank (max_restarts 0); stops the ranks together.
        self.supervisor = Supervisor([], max_restarts=0)

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.supervisor.children if c.pid is not None]

    def start(self, timeout_s: float = 120.0) -> list[str]:
        """Start every rank; their addresses once each has bound its port."""
        rendezvous = f"file://{self.folder / 'rendezvous'}"
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(self.threads_per_rank))
        env[PARENT_PID_ENV] = str(os.getpid())  # the workers exit if this process dies
        shares = rank_shares(self.world_size, self.threads_per_rank)
        for rank in range(self.world_size):
            cores = format_cpu_list(shares[rank]) if shares else None
            argv = self.command(rank, rendezvous, self._ready_file(rank), cores)
            child = Child.of_argv(f"worker rank {rank}", argv, group=RANKS, env=env)
            self.supervisor.children.append(child)
        self.supervisor.start()
        logger.info("mp: started %d worker processes %s", self.world_size, self.pids)
        try:
            return [self._wait_ready(rank, timeout_s) for rank in range(self.world_size)]
        except BaseException:
            self.close()
            raise

    def _ready_file(self, rank: int) -> Path:
        return self.folder / f"rank{rank}.address"

    def _wait_ready(self, rank: int, timeout_s: float) -> str:
        path = self._ready_file(rank)

        def address() -> str | None:
            return path.read_text().strip() if path.is_file() else None

        try:
            return self.supervisor.wait_ready(self.supervisor.children[rank], address, timeout_s)
        except ChildExited as exc:
            raise WorkerStartError(str(exc)) from None
        except TimeoutError:
            raise WorkerStartError(
                f"worker rank {rank} did not bind a port within {timeout_s}s"
            ) from None

    def check_alive(self) -> None:
        """Raise WorkerStartError naming the first rank whose process has exited."""
        try:
            self.supervisor.check_alive()
        except ChildExited as exc:
            raise WorkerStartError(f"{exc}; its log above says why") from None

    def close(self, timeout_s: float = 10.0) -> None:
        self.supervisor.stop_all(timeout_s)
        self.supervisor.children.clear()
        shutil.rmtree(self.folder, ignore_errors=True)
