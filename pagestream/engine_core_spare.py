"""SparePool: an engine-core interpreter started ahead of need, its imports done, waiting
for the command it will run.

Starting an engine-core process costs seconds before its model is even read (the
interpreter, torch, transformers, the C++ kernels: ~4-7 s on two cores), which a
multi-model serve would pay at every switch. A spare pays them while the server is idle:
`python -m pagestream.engine_core_spare` imports PRELOAD, then blocks on one JSON line on
its stdin, the argv (and environment) it then runs as `python -m MODULE ARGS...` would (an
EOF, its pool closed or its parent gone, ends it). Only the first start of a child uses a spare; a
restart starts a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import runpy
import subprocess
import sys
import threading

logger = logging.getLogger(__name__)

# What the engine-core role (`pagestream scheduler`, its own workers in-process) imports.
PRELOAD = (
    "torch",
    "pagestream.cli",
    "pagestream.roles",
    "pagestream.executor_factory",
    "services.scheduler.engine_core_builder",
    "services.scheduler.engine_core_service",
    "services.worker.worker",
    "pagestream_kernels.cpu",
)
MAX_COMMAND_BYTES = 1 << 20  # one argv line, our own


class SparePool:
    """At most one spare, made for one environment and process-group setting; `take`
    hands it a command (or, with none ready, starts the command as a new process), and
    `refill` starts the next spare once the caller's load no longer needs the CPU."""

    def __init__(self, env: dict[str, str] | None = None, own_process_group: bool = False):
        self.env = env
        self.group = 0 if own_process_group else None
        self._spare: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._closed = False

    def refill(self) -> None:
        with self._lock:
            if self._closed or (self._spare is not None and self._spare.poll() is None):
                return
            argv = [sys.executable, "-m", __name__]
            self._spare = subprocess.Popen(
                argv, stdin=subprocess.PIPE, env=self.env, process_group=self.group
            )
            logger.info("engine-core spare: process %d (its imports done ahead)", self._spare.pid)

    def take(self, argv: list[str], env: dict[str, str] | None, group: int | None):
        """A process running `argv`: the spare if one is alive and made for this env and
        group, else a new one (subprocess.Popen)."""
        with self._lock:
            spare, self._spare = self._spare, None
        alive = spare is not None and spare.poll() is None
        if not alive or group != self.group or not _same_at_import(env, self.env):
            if spare is not None:
                why = "it exited" if not alive else "made for another environment"
                logger.info("engine-core spare %d not used: %s", spare.pid, why)
            _discard(spare)
            return subprocess.Popen(argv, env=env, process_group=group)
        try:
            command = {"argv": argv, "env": dict(os.environ if env is None else env)}
            spare.stdin.write(json.dumps(command).encode() + b"\n")
            spare.stdin.close()
        except OSError:  # it died just now
            _discard(spare)
            return subprocess.Popen(argv, env=env, process_group=group)
        return spare

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, None
        _discard(spare)


# What is read when torch, OpenMP or Python start: a spare made under other values of
# these is no use (the rest of the environment is set before its command runs).
_READ_AT_IMPORT = (
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "LD_",
    "PYTHON",
    "CUDA_",
    "TORCH_",
    "PAGESTREAM_",
)


def _same_at_import(env: dict[str, str] | None, spare_env: dict[str, str] | None) -> bool:
    def read(e):
        e = os.environ if e is None else e
        return {k: v for k, v in e.items() if k.startswith(_READ_AT_IMPORT)}

    return read(env) == read(spare_env)


def _discard(spare: subprocess.Popen | None) -> None:
    if spare is None:
        return
    with contextlib.suppress(OSError):
        spare.stdin.close()  # EOF: it exits by itself
    try:
        spare.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        spare.kill()
        spare.wait()


def run_command(line: bytes) -> None:
    """Run `{"argv": [python, -m, MODULE, *args], "env": {...}}` in this interpreter, as
    `python -m` would under that environment."""
    command = json.loads(line)
    argv, env = command.get("argv"), command.get("env")
    if not isinstance(env, dict):
        raise SystemExit("engine-core spare: no environment in its command")
    if not (
        isinstance(argv, list)
        and len(argv) >= 3
        and all(isinstance(a, str) for a in argv)
        and argv[1] == "-m"
    ):
        raise SystemExit(f"engine-core spare: not a `python -m` command: {line[:200]!r}")
    os.environ.clear()
    os.environ.update(env)
    module, args = argv[2], argv[3:]
    sys.argv = [module, *args]
    # As under `python -m`: the module runs as __main__, and an import of it by name (a
    # preloaded one) is a separate module object, not one run_module would re-execute.
    sys.modules.pop(module, None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    try:  # the C++ kernels' library too (built on first use: then here, ahead)
        importlib.import_module("pagestream_kernels.cpu").load()
    except Exception as exc:  # the engine core says why, if it needs them
        logger.debug("engine-core spare: no C++ kernels (%s)", exc)
    line = sys.stdin.buffer.readline(MAX_COMMAND_BYTES)
    if not line.strip():
        os._exit(0)  # closed unused: nothing to run (and no atexit work worth waiting for)
    run_command(line)


if __name__ == "__main__":
    main()
