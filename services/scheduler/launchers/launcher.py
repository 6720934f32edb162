"""The Launcher protocol: what starts and stops the processes of a worker group.

A launcher is not an executor: it only brings `pagestream worker` processes up (its
`start()` returns their addresses in rank order) and takes them down again; the engine
core drives those addresses through a WorkerGroupExecutor, which owns its launcher and
closes it with itself. `mp` (mp_launcher.py) starts local processes, `ray`
(ray_launcher.py) lets Ray place them.
"""

from __future__ import annotations

from typing import Protocol

# A worker started with this variable exits when that process is gone (no orphans, even
# when the engine is killed without cleanup).
PARENT_PID_ENV = "PAGESTREAM_PARENT_PID"


class WorkerStartError(RuntimeError):
    """A worker process exited or did not come up in time."""


class Launcher(Protocol):
    @property
    def pids(self) -> list[int]: ...

    def start(self, timeout_s: float) -> list[str]:
        """Start every rank; their addresses in rank order once each listens."""
        ...

    def check_alive(self) -> None:
        """Raise WorkerStartError naming the first rank whose process is gone."""
        ...

    def close(self) -> None: ...
