"""The mp backend's worker processes live and die with their engine: they stop when the
engine is closed, and exit by themselves when the engine process is killed (no orphans)."""

import signal
import subprocess
import sys

import pytest

from tests.helpers.eventually import eventually
from tests.helpers.processes import alive, gone

SCRIPT = """
import sys
from pagestream import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_memory="1MiB", swap_space=0.01)
print(*llm.engine.executor.launcher.pids, flush=True)
sys.stdin.read()  # until the test kills us
"""


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
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        engine.send_signal(signal.SIGKILL)  # no cleanup at all
        engine.wait(timeout=10)
        eventually(lambda: gone(pids), f"workers {pids} gone with their engine")
    finally:
        if engine.poll() is None:
            engine.kill()


def test_workers_stop_when_the_engine_is_closed(model_dir):
    from pagestream import LLM

    llm = LLM(str(model_dir("llama")), tensor_parallel_size=2, kv_cache_memory="1MiB")
    pids = llm.engine.executor.launcher.pids
    assert all(alive(pid) for pid in pids)
    llm.engine.close()
    eventually(lambda: gone(pids), f"workers {pids} gone with their engine")
    with pytest.raises(ConnectionError, match="closed"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)
