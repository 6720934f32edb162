"""EngineCoreProcess: the engine core (scheduler + executor) in a child process of its own.

`serve` and `AsyncEngine` run the step apart from the frontend (as vLLM V1 does), so text
work and the step never wait on each other's interpreter lock. The child is the `scheduler`
role serving EngineCore on a unix socket in a private folder, kept alive by a Supervisor;
the frontend's reconnect logic finds a restarted child on the same socket. The child exits
by itself when this process is gone, even after a SIGKILL ($PAGESTREAM_PARENT_PID).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import weakref
from functools import partial
from pathlib import Path

from pagestream.cli_flags import role_argv
from pagestream.engine_args import EngineArgs
from pagestream.engine_core_spare import SparePool
from services.common.grpc_channel import (
    RECONNECT_OPTIONS,
    sync_channel,
    wait_until_serving_sync,
)
from services.common.served_model_info import ServedModelInfo
from services.common.supervisor import RESTART_WINDOW_S, Child, ChildExited, Supervisor
from services.scheduler.launchers.launcher import PARENT_PID_ENV

logger = logging.getLogger(__name__)


def child_env() -> dict[str, str]:
    """The engine-core child's environment: this one, and whose child it is (it exits
    when this process is gone)."""
    return dict(os.environ, **{PARENT_PID_ENV: str(os.getpid())})


def spare_pool() -> SparePool:
    """Spares for EngineCoreProcess children (made for their environment and group)."""
    return SparePool(child_env(), own_process_group=True)


class EngineCoreStartError(RuntimeError):
    """The engine-core process exited or did not report SERVING in time."""


class EngineCoreProcess:
    def __init__(
        self,
        args: EngineArgs,
        log_level: str | None = None,
        max_restarts: int = 5,
        startup_timeout_s: float = 600.0,
        spares: SparePool | None = None,
    ) -> None:
        """`spares`: where the child's first start takes an interpreter whose imports are
        done (a multi-model serve's); None: a fresh one."""
        self.args = args
        self.log_level = log_level or logging.getLevelName(logging.getLogger().level)
        self.startup_timeout_s = startup_timeout_s
        # A unix socket's path has ~100 bytes at most: a long $TMPDIR falls back to /tmp.
        parent = None if len(tempfile.gettempdir()) < 60 else "/tmp"
        self.folder = Path(tempfile.mkdtemp(prefix="pagestream-core-", dir=parent))
        self.socket_path = self.folder / "engine-core.sock"
        self.child = Child.of_argv(
            "the engine-core process",
            self.command(),
            env=child_env(),
            # Its own process group: a Ctrl-C at the terminal reaches this process only,
            # which then stops the child in order (instead of racing its watcher with a
            # restart). Not its own session: with the kernel's autogroups a session is a
            # fairness group, which costs the child throughput against the parent.
            own_process_group=True,
            # A dead child's socket file goes before each start.
            prepare=partial(self.socket_path.unlink, missing_ok=True),
            spawn=None if spares is None else spares.take,
        )
        self.supervisor = Supervisor([self.child], max_restarts=max_restarts)
        self._watcher: threading.Thread | None = None
        # Stopped with this object, or at exit at the latest (a dropped engine); the
        # supervisor holds no reference back to this object.
        weakref.finalize(self, self.supervisor.stop_all, 5.0)

    @property
    def address(self) -> str:
        """The EngineCore service's gRPC address (a unix socket)."""
        return f"unix:{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return self.child.pid

    @property
    def gave_up(self) -> str | None:
        """Why the child is no longer restarted (None while it is)."""
        if self.supervisor.gave_up is None:
            return None
        deaths = len(self.child.restarts) + 1
        return f"the engine core died {deaths} times within {RESTART_WINDOW_S:.0f}s"

    def command(self) -> list[str]:
        where = ["--host", self.address]
        return [
            sys.executable,
            *role_argv("scheduler", self.args.model, where, self.args, log_level=self.log_level),
        ]

    def start(self) -> ServedModelInfo:
        """Launch the child; its model facts once it serves (EngineCoreStartError if not).
        From then on a child that dies is restarted until the supervisor gives up."""
        try:
            self.supervisor.start()
            logger.info("engine core: process %d on %s", self.pid, self.address)
            info = self._wait_serving()
        except BaseException:
            self.close()
            raise
        self._watcher = threading.Thread(
            target=self.supervisor.watch, name="pagestream-engine-core-watch", daemon=True
        )
        self._watcher.start()
        return info

    def _wait_serving(self) -> ServedModelInfo:
        from services.frontend.grpc_engine_client import ENGINE_CORE_SERVICE, engine_info_sync

        with sync_channel(self.address, options=RECONNECT_OPTIONS) as channel:

            def serving() -> bool:
                try:
                    wait_until_serving_sync(channel, ENGINE_CORE_SERVICE, 1.0, self.address)
                except TimeoutError:
                    return False
                return True

            try:
                self.supervisor.wait_ready(self.child, serving, self.startup_timeout_s)
            except ChildExited as exc:
                raise EngineCoreStartError(
                    f"the engine-core process (pid {self.pid}) exited with {exc.code} "
                    "while starting; its log above says why"
                ) from None
            except TimeoutError:
                raise EngineCoreStartError(
                    f"the engine core did not report SERVING within {self.startup_timeout_s}s"
                ) from None
            return engine_info_sync(channel)

    def close(self, grace_s: float = 10.0) -> None:
        """Stop the child (SIGTERM, then SIGKILL after grace_s) and remove its folder."""
        self.supervisor.stop()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)
        self.supervisor.stop_all(grace_s)
        shutil.rmtree(self.folder, ignore_errors=True)
