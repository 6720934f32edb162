"""The part of a standalone benchmark's results that says how it ran: the command that
reproduces it, the machine (CPU name, cores, versions), the threads each side used and the
load average around the run (a busy machine's figures are not comparable)."""

from __future__ import annotations

import os
import shlex


def command_of(module: str, argv: list[str]) -> str:
    """The command line that reruns `module` with `argv`."""
    return shlex.join(["python", "-m", module, *argv])


def run_header(module: str, argv: list[str], threads: int) -> dict:
    """The header, the load average taken now (`finish` adds the end's)."""
    from benchmarks.results import machine_info

    return {
        "command": command_of(module, argv),
        "machine": machine_info(),
        "threads": threads,
        "load_average": {"start": round(os.getloadavg()[0], 2)},
    }


def finish(header: dict) -> dict:
    """`header` with the load average at the end of the run."""
    load = {**header["load_average"], "end": round(os.getloadavg()[0], 2)}
    return {**header, "load_average": load}
