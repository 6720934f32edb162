"""TargetProcess: a multiprocessing target in a spawned process, behind Popen's interface
(pid, poll, send_signal, kill, wait), so a Supervisor treats it as it does a command.
Spawned, not forked: a fork of a process with threads may deadlock on a lock some thread
held.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from collections.abc import Callable


class TargetProcess:
    """`target(generation)` running in a process of its own."""

    def __init__(self, target: Callable[[int], None], generation: int) -> None:
        self._process = multiprocessing.get_context("spawn").Process(
            target=target, args=(generation,), daemon=False
        )
        self._process.start()
        self.pid = self._process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:  # not yet reaped: the pid is still its own
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self._process.exitcode
