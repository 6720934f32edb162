"""The part of a standalone benchmark's results that says how it ran: the command that
reproduces it, the machine (CPU name, cores, versions), the threads each side used and the
load average around the run (a busy machine's figures are not comparable)."""

from __future__ import annotations

import json
import logging
import os
import shlex
from collections.abc import Callable


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


def run_main(
    module: str,
    argv: list[str],
    parse_options: Callable[[list[str]], tuple],
    run: Callable[[object], dict],
    summary: Callable[[dict], dict],
) -> int:
    """A standalone benchmark's main: its options (and --out) parsed, `run(options)` under
    the header, the results written to --out, `summary(results)` printed. A ValueError (a
    feature this build lacks, a bad option) ends it with its message."""
    options, out = parse_options(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    header = run_header(module, argv, options.threads)
    try:
        result = finish({**header, **run(options)})
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    if out:
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary(result)))
    return 0
