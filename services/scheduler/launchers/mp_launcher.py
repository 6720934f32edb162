"""MpLauncher: the `mp` backend: tp * pp local Worker processes.

Each rank is a `pagestream worker` process (the command comes from the caller, who knows
the CLI) that binds a free loopback port and writes its address to a ready file; the
ranks meet through a file rendezvous in a private temporary folder (no race for ports).
`start()` returns the addresses in rank order for a WorkerGroupExecutor; `close()` stops
every process (SIGTERM, then SIGKILL) and removes the folder. On the CPU each rank gets
an equal share of the cores (OMP_NUM_THREADS), and its own cores to pin its threads to
($PAGESTREAM_CPU_CORES, see services/common/cpu_cores.py), unless the caller set them.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from services.common.cpu_cores import CPU_CORES_ENV, format_cpu_list, rank_shares
from services.scheduler.launchers.launcher import PARENT_PID_ENV, WorkerStartError

logger = logging.getLogger(__name__)

# rank, rendezvous (file://...), ready file -> argv of that rank's worker process
WorkerCommand = Callable[[int, str, Path], list[str]]


class MpLauncher:
    def __init__(self, world_size: int, command: WorkerCommand, threads_per_rank: int = 0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        self.world_size = world_size
        self.command = command
        self.threads_per_rank = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        self.folder = Path(tempfile.mkdtemp(prefix="pagestream-mp-"))
        self.processes: list[subprocess.Popen] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def start(self, timeout_s: float = 120.0) -> list[str]:
        """Start every rank; their addresses once each has bound its port."""
        rendezvous = f"file://{self.folder / 'rendezvous'}"
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(self.threads_per_rank))
        env[PARENT_PID_ENV] = str(os.getpid())  # the workers exit if this process dies
        shares = [] if CPU_CORES_ENV in env else rank_shares(self.world_size, self.threads_per_rank)
        for rank in range(self.world_size):
            argv = self.command(rank, rendezvous, self._ready_file(rank))
            if shares:  # each rank pins its threads to cores of its own
                env[CPU_CORES_ENV] = format_cpu_list(shares[rank])
            self.processes.append(subprocess.Popen(argv, env=env))
        logger.info("mp: started %d worker processes %s", self.world_size, self.pids)
        try:
            return [self._wait_ready(rank, timeout_s) for rank in range(self.world_size)]
        except BaseException:
            self.close()
            raise

    def _ready_file(self, rank: int) -> Path:
        return self.folder / f"rank{rank}.address"

    def _wait_ready(self, rank: int, timeout_s: float) -> str:
        path, process = self._ready_file(rank), self.processes[rank]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.is_file() and (address := path.read_text().strip()):
                return address
            if (code := process.poll()) is not None:
                raise WorkerStartError(f"worker rank {rank} (pid {process.pid}) exited with {code}")
            time.sleep(0.05)
        raise WorkerStartError(f"worker rank {rank} did not bind a port within {timeout_s}s")

    def check_alive(self) -> None:
        """Raise WorkerStartError naming the first rank whose process has exited."""
        for rank, process in enumerate(self.processes):
            if (code := process.poll()) is not None:
                raise WorkerStartError(
                    f"worker rank {rank} (pid {process.pid}) exited with {code}; "
                    "its log above says why"
                )

    def close(self, timeout_s: float = 10.0) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []
        shutil.rmtree(self.folder, ignore_errors=True)
