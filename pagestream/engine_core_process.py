"""EngineCoreProcess: the engine core (scheduler + executor) in a child process of its own.

`pagestream serve` and `AsyncEngine` run the step apart from the frontend (HTTP, gRPC,
tokenizer, detokenizer), as vLLM V1 does, so text work never waits on the interpreter lock
of the step and the step never waits on the frontend's. The child is the `scheduler` role
(`python -m pagestream.cli scheduler MODEL`, its own workers: in process for world size 1,
mp processes beyond) serving EngineCore on a unix socket in a private folder; the parent
connects to it with the same gRPC client a split frontend uses.

Life cycle: `start()` launches the child and returns once it reports SERVING (or raises
with its exit code when it dies while loading). A watcher thread restarts a child that
dies unexpectedly (backoff 1, 2, 4 ... s; more than `max_restarts` within five minutes:
it gives up and `gave_up` says why); the frontend's reconnect logic finds the new one on
the same socket. `close()` stops it (SIGTERM, SIGKILL after a grace). The child exits by
itself when this process is gone, even after a SIGKILL ($PAGESTREAM_PARENT_PID).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from pathlib import Path

from pagestream.cli_flags import role_argv
from pagestream.engine_args import EngineArgs
from pagestream.supervisor import terminate
from services.common.backoff import Backoff
from services.common.grpc_channel import (
    RECONNECT_OPTIONS,
    sync_channel,
    wait_until_serving_sync,
)
from services.common.restart_policy import RestartPolicy
from services.common.served_model_info import ServedModelInfo
from services.scheduler.launchers.launcher import PARENT_PID_ENV

logger = logging.getLogger(__name__)

BACKOFF = Backoff((1.0, 2.0, 4.0, 8.0, 16.0))
RESTART_WINDOW_S = 300.0


class EngineCoreStartError(RuntimeError):
    """The engine-core process exited or did not report SERVING in time."""


class EngineCoreProcess:
    def __init__(
        self,
        args: EngineArgs,
        log_level: str | None = None,
        max_restarts: int = 5,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.args = args
        self.log_level = log_level or logging.getLevelName(logging.getLogger().level)
        self.max_restarts = max_restarts
        self.restart_policy = RestartPolicy(BACKOFF, max_restarts, RESTART_WINDOW_S)
        self.startup_timeout_s = startup_timeout_s
        # A unix socket's path has ~100 bytes at most: a long $TMPDIR falls back to /tmp.
        parent = None if len(tempfile.gettempdir()) < 60 else "/tmp"
        self.folder = Path(tempfile.mkdtemp(prefix="pagestream-core-", dir=parent))
        self.socket_path = self.folder / "engine-core.sock"
        self.process: subprocess.Popen | None = None
        self.gave_up: str | None = None
        self._restarts: deque[float] = deque()
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def address(self) -> str:
        """The EngineCore service's gRPC address (a unix socket)."""
        return f"unix:{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def command(self) -> list[str]:
        where = ["--host", self.address]
        return [
            sys.executable,
            *role_argv("scheduler", self.args.model, where, self.args, log_level=self.log_level),
        ]

    # ---- start / stop ----------------------------------------------------------------
    def start(self) -> ServedModelInfo:
        """Launch the child; its model facts once it serves (EngineCoreStartError if not)."""
        try:
            self._launch()
            info = self._wait_serving()
        except BaseException:
            self.close()
            raise
        self._watcher = threading.Thread(
            target=self._watch, name="pagestream-engine-core-watch", daemon=True
        )
        self._watcher.start()
        return info

    def _launch(self) -> None:
        self.socket_path.unlink(missing_ok=True)  # a dead child's socket file
        env = dict(os.environ, **{PARENT_PID_ENV: str(os.getpid())})
        # Its own process group: a Ctrl-C at the terminal reaches this process only, which
        # then stops the child in order (instead of racing its watcher with a restart). Not
        # its own session: with the kernel's autogroups a session is a fairness group, which
        # costs the child throughput against the parent under many streams.
        self.process = subprocess.Popen(self.command(), env=env, process_group=0)
        # Stopped with this object, or at exit at the latest (a dropped engine).
        weakref.finalize(self, terminate, [self.process], 5.0)
        logger.info("engine core: started process %d on %s", self.process.pid, self.address)

    def _wait_serving(self) -> ServedModelInfo:
        from services.frontend.grpc_engine_client import ENGINE_CORE_SERVICE, engine_info_sync

        deadline = time.monotonic() + self.startup_timeout_s
        with sync_channel(self.address, options=RECONNECT_OPTIONS) as channel:
            while True:
                if (code := self.process.poll()) is not None:
                    raise EngineCoreStartError(
                        f"the engine-core process (pid {self.process.pid}) exited with {code} "
                        "while starting; its log above says why"
                    )
                if time.monotonic() > deadline:
                    raise EngineCoreStartError(
                        f"the engine core did not report SERVING within {self.startup_timeout_s}s"
                    )
                try:
                    wait_until_serving_sync(channel, ENGINE_CORE_SERVICE, 1.0, self.address)
                    break
                except TimeoutError:
                    continue
            return engine_info_sync(channel)

    def close(self, grace_s: float = 10.0) -> None:
        """Stop the child (SIGTERM, then SIGKILL after grace_s) and remove its folder."""
        self._closing.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)
        if self.process is not None:
            terminate([self.process], grace_s)
        shutil.rmtree(self.folder, ignore_errors=True)

    # ---- the watcher -----------------------------------------------------------------
    def _watch(self, poll_s: float = 0.2) -> None:
        """Restart the child when it dies while we are not closing."""
        while not self._closing.wait(poll_s):
            code = self.process.poll()
            if code is None:
                continue
            logger.error("the engine-core process (pid %d) exited with %s", self.process.pid, code)
            delay = self._next_backoff()
            if delay is None or self._closing.wait(delay):
                return
            try:
                self._launch()
            except OSError as exc:
                logger.error("could not restart the engine core: %s", exc)

    def _next_backoff(self) -> float | None:
        delay = self.restart_policy.next_delay(self._restarts, time.monotonic())
        if delay is None:
            self.gave_up = (
                f"the engine core died {len(self._restarts) + 1} times within "
                f"{RESTART_WINDOW_S:.0f}s"
            )
            logger.error("%s: not restarting it again", self.gave_up)
            return None
        logger.warning("restarting the engine core in %.0fs", delay)
        return delay
