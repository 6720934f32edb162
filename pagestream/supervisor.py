"""Supervisor: `serve --split-services` keeps its child roles alive.

Each role is a child process started from a command; a child that exits while the
supervisor is not stopping is started again after a backoff (1, 2, 4 ... capped), and the
log says which role, its pid, its exit code and the attempt. Roles in one `group` (the
ranks of a worker group: a process group cannot outlive a member) restart together, each
time with a new generation number (a fresh rendezvous). More than `max_restarts` restarts
of one role within `window_s` seconds: the supervisor gives up, stops everything and
returns non-zero. SIGTERM / SIGINT stop every child, the last started first (SIGTERM, then
SIGKILL after a grace).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.backoff import Backoff
from services.common.restart_policy import RestartPolicy

logger = logging.getLogger("pagestream.supervisor")

BACKOFF = Backoff((1.0, 2.0, 4.0, 8.0, 16.0))
RESTART_GRACE_S = 2.0


@dataclass
class Role:
    name: str
    command: Callable[[int], list[str]]  # generation -> argv
    group: str | None = None
    process: subprocess.Popen | None = None
    generation: int = 0
    restarts: deque = field(default_factory=deque)  # monotonic times of recent restarts

    def start(self) -> None:
        self.process = subprocess.Popen(self.command(self.generation))
        logger.info("started %s (pid %d)", self.name, self.process.pid)

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()


class Supervisor:
    def __init__(
        self,
        roles: list[Role],
        max_restarts: int = 5,
        window_s: float = 300.0,
        grace_s: float = 15.0,
    ) -> None:
        self.roles = roles
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.restart_policy = RestartPolicy(BACKOFF, max_restarts, window_s)
        self.grace_s = grace_s
        self.stopping = False
        self.gave_up: str | None = None

    @property
    def pids(self) -> dict[str, int]:
        return {r.name: r.process.pid for r in self.roles if r.process is not None}

    def run(self, poll_s: float = 0.2) -> int:
        """Start every role and watch them until a signal or a give-up; the exit code."""
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        for role in self.roles:
            role.start()
        try:
            while not self.stopping:
                self._check_children()
                time.sleep(poll_s)
        finally:
            codes = self._stop_all()
        logger.info("roles exited with %s", codes)
        return 1 if self.gave_up else 0

    def stop(self, *_args) -> None:
        self.stopping = True

    def _check_children(self) -> None:
        for role in self.roles:
            code = role.exit_code()
            if code is None or self.stopping:
                continue
            logger.error("%s (pid %d) exited with code %s", role.name, role.process.pid, code)
            self._restart(role)

    def _restart(self, role: Role) -> None:
        delay = self.restart_policy.next_delay(role.restarts, time.monotonic())
        if delay is None:
            self.gave_up = role.name
            logger.error(
                "%s died %d times within %.0f s: giving up, stopping every role",
                role.name,
                len(role.restarts) + 1,
                self.window_s,
            )
            self.stopping = True
            return
        group = [r for r in self.roles if role.group is not None and r.group == role.group]
        group = group or [role]
        logger.warning(
            "restarting %s in %.0f s (restart %d of at most %d in %.0f s)",
            ", ".join(r.name for r in group),
            delay,
            len(role.restarts),
            self.max_restarts,
            self.window_s,
        )
        # The others of a broken group cannot serve anyway: no long drain for them.
        grace = min(self.grace_s, RESTART_GRACE_S) if len(group) > 1 else self.grace_s
        terminate([r.process for r in group if r.exit_code() is None], grace)
        self._sleep(delay)
        for member in group:
            if self.stopping:
                return
            member.generation += 1
            member.start()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(0.05)

    def _stop_all(self) -> list[int | None]:
        """Last started first (the frontend, then the schedulers, then the workers), as
        compose stops services: a frontend draining its streams still has its engines."""
        processes = [r.process for r in self.roles if r.process is not None]
        for process in reversed(processes):
            if process.poll() is None:
                terminate([process], self.grace_s)
        return [p.poll() for p in processes]


def terminate(processes: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every process, then SIGKILL what is left after grace_s (one that has
    already exited is left alone)."""
    processes = [p for p in processes if p.poll() is None]
    for process in processes:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
