"""Supervisor: the one set of rules that starts, watches, restarts and stops child processes.

A child that dies while the supervisor is not stopping is restarted after the RestartPolicy's
backoff, together with its restart group (a process group cannot outlive a member), each
member with a new generation (a fresh rendezvous); past `max_restarts` within the window it
gives up and stops every child. Stopping goes last started first (SIGTERM, SIGKILL after a
grace). Logs name the child, its pid, its exit code and the attempt. No torch here: the
scheduler's mp launcher uses it too.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from services.common.backoff import Backoff
from services.common.restart_policy import RestartPolicy
from services.common.target_process import TargetProcess

logger = logging.getLogger(__name__)

# Between restarts of a child that keeps dying: 1, 2, 4 ... s, capped.
CHILD_BACKOFF = Backoff((1.0, 2.0, 4.0, 8.0, 16.0))
RESTART_WINDOW_S = 300.0
# The others of a broken restart group cannot serve anyway: no long drain for them.
GROUP_RESTART_GRACE_S = 2.0

T = TypeVar("T")


class Process(Protocol):
    """What the supervisor needs of a child (subprocess.Popen has it)."""

    pid: int

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


class ChildExited(RuntimeError):
    """A child exited while its owner waited for it (to be ready, or to stay alive)."""

    def __init__(self, child: Child, code: int) -> None:
        super().__init__(f"{child.name} (pid {child.pid}) exited with {code}")
        self.child, self.code = child, code


@dataclass
class Child:
    """One supervised child: a command (argv per generation) or a multiprocessing target
    (called with the generation in a spawned process)."""

    name: str
    command: Callable[[int], list[str]] | None = None
    target: Callable[[int], None] | None = None
    group: str | None = None  # the children of one group restart together
    env: dict[str, str] | None = None  # a command's environment (default: this process's)
    own_process_group: bool = False  # a terminal's Ctrl-C reaches the supervisor only
    prepare: Callable[[], None] | None = None  # before each start (a dead child's leftovers)
    # A command's first start: spawn(argv, env, process_group) -> Process, e.g. an
    # interpreter started ahead (pagestream/engine_core_spare.py); restarts use Popen.
    spawn: Callable[[list[str], dict[str, str] | None, int | None], Process] | None = None
    process: Process | None = None
    generation: int = 0
    restarts: deque = field(default_factory=deque)  # monotonic times of recent restarts

    def __post_init__(self) -> None:
        if (self.command is None) == (self.target is None):
            raise ValueError(f"child {self.name}: give exactly one of command and target")

    @classmethod
    def of_argv(cls, name: str, argv: list[str], **options) -> Child:
        """A child whose command is the same at every generation."""
        return cls(name, lambda _generation: argv, **options)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        if self.prepare is not None:
            self.prepare()
        if self.command is not None:
            group = 0 if self.own_process_group else None
            argv = self.command(self.generation)
            if self.spawn is not None and self.generation == 0:
                self.process = self.spawn(argv, self.env, group)
            else:
                self.process = subprocess.Popen(argv, env=self.env, process_group=group)
        else:
            self.process = TargetProcess(self.target, self.generation)
        logger.info("started %s (pid %d, generation %d)", self.name, self.pid, self.generation)

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()


class Supervisor:
    def __init__(
        self,
        children: list[Child],
        max_restarts: int = 5,
        grace_s: float = 15.0,
        backoff: Backoff = CHILD_BACKOFF,
        window_s: float = RESTART_WINDOW_S,
    ) -> None:
        self.children = children
        self.policy = RestartPolicy(backoff, max_restarts, window_s)
        self.grace_s = grace_s
        self.stopping = False  # a plain flag: signal handlers set it
        self.gave_up: str | None = None  # the child given up on

    @property
    def pids(self) -> dict[str, int]:
        return {c.name: c.pid for c in self.children if c.process is not None}

    def start(self) -> None:
        for child in self.children:
            child.start()

    def run(self, poll_s: float = 0.2) -> int:
        """Start every child and watch them until SIGTERM / SIGINT or a give-up (main
        thread only); the exit code: 1 after a give-up, else 0."""
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        try:
            self.start()
            self.watch(poll_s)
        finally:
            codes = self.stop_all()
        logger.info("children exited with %s", codes)
        return 1 if self.gave_up else 0

    def watch(self, poll_s: float = 0.2) -> None:
        """Restart the children that die, until stopped or given up."""
        while not self.stopping:
            self.check()
            self._sleep(poll_s)

    def stop(self, *_args) -> None:
        self.stopping = True

    def check(self) -> None:
        for child in self.children:
            code = child.exit_code()
            if code is None or self.stopping:
                continue
            logger.error("%s (pid %d) exited with %s", child.name, child.pid, code)
            self._restart(child)

    def restart_delay(self, child: Child) -> float | None:
        """After `child` died: the wait before its restart, or None when it died too often
        (then the supervisor gives up and stops)."""
        delay = self.policy.next_delay(child.restarts, time.monotonic())
        if delay is None:
            self.gave_up = child.name
            logger.error(
                "%s died %d times within %.0f s: giving up, stopping every child",
                child.name,
                len(child.restarts) + 1,
                self.policy.window_s,
            )
            self.stopping = True
        return delay

    def _restart(self, child: Child) -> None:
        delay = self.restart_delay(child)
        if delay is None:
            return
        group = [c for c in self.children if child.group is not None and c.group == child.group]
        group = group or [child]
        logger.warning(
            "restarting %s in %.0f s (restart %d of at most %d in %.0f s)",
            ", ".join(c.name for c in group),
            delay,
            len(child.restarts),
            self.policy.max_restarts,
            self.policy.window_s,
        )
        grace = min(self.grace_s, GROUP_RESTART_GRACE_S) if len(group) > 1 else self.grace_s
        terminate([c.process for c in group if c.exit_code() is None], grace)
        self._sleep(delay)
        for member in group:
            if self.stopping:
                return
            member.generation += 1
            try:
                member.start()
            except OSError as exc:  # seen dead at the next check: the policy decides
                logger.error("could not restart %s: %s", member.name, exc)

    def wait_ready(
        self, child: Child, probe: Callable[[], T], timeout_s: float, poll_s: float = 0.05
    ) -> T:
        """`probe()`'s first truthy result while `child` lives; ChildExited when it exits
        first, TimeoutError past `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            if result := probe():
                return result
            if (code := child.exit_code()) is not None:
                raise ChildExited(child, code)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} was not ready within {timeout_s}s")
            time.sleep(poll_s)

    def check_alive(self) -> None:
        """ChildExited for the first child that has exited."""
        for child in self.children:
            if (code := child.exit_code()) is not None:
                raise ChildExited(child, code)

    def stop_all(self, grace_s: float | None = None) -> list[int | None]:
        """Stop every child, last started first (a frontend draining its streams still has
        its engines), a restart group's members together; each SIGTERM, then SIGKILL after
        the grace. Their exit codes, in start order."""
        self.stopping = True
        grace = self.grace_s if grace_s is None else grace_s
        started = [c for c in self.children if c.process is not None]
        batch: list[Child] = []
        for child in reversed(started):
            if batch and (child.group is None or child.group != batch[0].group):
                terminate([c.process for c in batch], grace)
                batch = []
            batch.append(child)
        terminate([c.process for c in batch], grace)
        return [c.process.poll() for c in started]

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(0.05)


def terminate(processes: list[Process], grace_s: float) -> None:
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
