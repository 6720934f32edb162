"""A benchmark function run in a fresh Python process: its own threads (OMP_NUM_THREADS set
before torch starts), nothing loaded before it, its result back as JSON. The benchmarks of
loads, restarts and KV dtypes need every side to start from nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# The child imports the target and prints its result as the last line of its stdout.
_CHILD = """
import importlib, json, sys
module, name = sys.argv[1].split(":")
result = getattr(importlib.import_module(module), name)(**json.loads(sys.argv[2]))
print(json.dumps(result))
"""
TAIL_CHARS = 4000  # of a failed child's stderr, in the error


def child_call(target: str, threads: int, timeout_s: float = 3600, **kwargs) -> dict:
    """`target` ("module:function") called with `kwargs` (JSON values) in a new interpreter
    with `threads` threads; its JSON result. RuntimeError with the child's stderr's end
    where it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-c", _CHILD, target, json.dumps(kwargs)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"{target} failed in its child process:\n{done.stderr[-TAIL_CHARS:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
