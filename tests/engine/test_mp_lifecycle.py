"""The mp backend's worker processes live and die with their engine: they stop when the
engine is closed, and exit by themselves when the engine process is killed (no orphans)."""

import os
import signal
import subprocess
import sys
import time

import pytest

SCRIPT = """
import sys
from pagestream import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_memory="1MiB", swap_space=0.01)
print(*llm.engine.executor.launcher.pids, flush=True)
sys.stdin.read()  # until the test kills us
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is as good as gone
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"workers {pids} outlived their engine"
        time.sleep(0.2)


def test_workers_exit_when_the_engine_is_killed(model_dir):
    engine = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(model_dir("llama"))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = engine.stdout.readline()
        pids = [int(pid) for pid in line.split()]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        engine.send_signal(signal.SIGKILL)  # no cleanup at all
        engine.wait(timeout=10)
        _wait_gone(pids, 15)
    finally:
        if engine.poll() is None:
            engine.kill()


def test_workers_stop_when_the_engine_is_closed(model_dir):
    from pagestream import LLM

    llm = LLM(str(model_dir("llama")), tensor_parallel_size=2, kv_cache_memory="1MiB")
    pids = llm.engine.executor.launcher.pids
    assert all(_alive(pid) for pid in pids)
    llm.engine.close()
    _wait_gone(pids, 15)
    with pytest.raises(ConnectionError, match="closed"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)
