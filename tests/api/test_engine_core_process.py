"""The engine core in a process of its own (AsyncEngine's and serve's default layout):
it streams what the in-process engine computes, rejects bad input with a clear error,
aborts, is restarted after it is killed (its requests end with an error, later ones are
served), stops with its engine, and exits by itself when its parent is SIGKILLed."""

import asyncio
import signal
import subprocess
import sys

import pytest
import pytest_asyncio

from pagestream import LLM, AsyncEngine, RequestOutputKind, SamplingParams
from services.common.engine_errors import EngineUnavailableError
from tests.helpers.eventually import eventually, eventually_async
from tests.helpers.processes import alive, cmdline, descendants, gone

# The async tests share the module's event loop (and so its engine and its frontend).
module_loop = pytest.mark.asyncio(loop_scope="module")

PROMPT = {"prompt_token_ids": [5, 17, 33, 99, 250, 12, 8, 41]}
ENGINE = dict(kv_cache_memory="8MiB", swap_space=0.01)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
RESTART_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(str(model_dir("llama")), **ENGINE)
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    llm.engine.close()
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir):
    engine = await asyncio.to_thread(AsyncEngine.from_args, str(model_dir("llama")), **ENGINE)
    yield engine
    await engine.shutdown()


async def _final(engine, params=GREEDY, request_id=None):
    outputs = [out async for out in engine.generate(PROMPT, params, request_id)]
    return outputs[-1]


@module_loop
async def test_the_engine_core_runs_in_a_child_process(engine):
    pid = engine.process.pid
    assert engine.engine is None and engine.engine_core is None
    assert alive(pid) and "scheduler" in cmdline(pid)


@module_loop
async def test_streams_what_the_in_process_engine_computes(engine, expected):
    final = await _final(engine)
    assert final.outputs[0].token_ids == expected.token_ids
    assert final.outputs[0].text == expected.text
    delta = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    deltas = [out async for out in engine.generate(PROMPT, delta)]
    assert [t for d in deltas for t in d.outputs[0].token_ids] == expected.token_ids
    assert len(deltas) > 1  # it streamed


@module_loop
async def test_concurrent_requests_each_get_their_own_tokens(engine, expected):
    finals = await asyncio.gather(*(_final(engine) for _ in range(6)))
    assert all(f.outputs[0].token_ids == expected.token_ids for f in finals)


@module_loop
async def test_bad_input_is_a_clear_error_and_the_engine_serves_on(engine, expected):
    too_long = {"prompt_token_ids": [5] * (engine.info.max_model_len + 1)}
    with pytest.raises(ValueError, match="max_model_len"):
        async for _ in engine.generate(too_long, GREEDY):
            pass
    assert (await _final(engine)).outputs[0].token_ids == expected.token_ids


@module_loop
async def test_abort_ends_the_stream_and_frees_the_request(engine):
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    seen = []

    async def consume():
        async for out in engine.generate(PROMPT, params, "to-abort"):
            seen.append(out)

    task = asyncio.create_task(consume())
    await eventually_async(lambda: len(seen) >= 2, "two outputs streamed")
    await engine.abort("to-abort")
    await asyncio.wait_for(task, timeout=30)
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    stats = await engine.frontend.stats()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


@module_loop
async def test_a_killed_engine_core_is_restarted(engine, expected):
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    old_pid = engine.process.pid
    seen = []

    async def consume():
        async for out in engine.generate(PROMPT, params):
            seen.append(out)

    task = asyncio.create_task(consume())
    await eventually_async(lambda: seen, "an output streamed")
    subprocess.run(["kill", "-KILL", str(old_pid)], check=True)
    with pytest.raises(EngineUnavailableError):
        await asyncio.wait_for(task, timeout=30)
    await eventually_async(
        lambda: engine.frontend.is_ready, "the engine core back", timeout=RESTART_TIMEOUT_S
    )
    assert engine.process.pid != old_pid and alive(engine.process.pid)
    assert (await _final(engine)).outputs[0].token_ids == expected.token_ids


SCRIPT = """
import sys
from pagestream import AsyncEngine
engine = AsyncEngine.from_args(sys.argv[1], kv_cache_memory="8MiB", swap_space=0.01)
print(engine.process.pid, flush=True)
sys.stdin.read()  # until the test kills us
"""


def test_the_engine_core_exits_when_its_parent_is_killed(model_dir):
    parent = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(model_dir("llama"))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid = int(parent.stdout.readline())
        assert alive(pid) and pid in descendants(parent.pid)
        parent.send_signal(signal.SIGKILL)  # no cleanup at all
        parent.wait(timeout=10)
        eventually(lambda: gone([pid]), f"the engine core {pid} gone with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()


@module_loop
async def test_shutdown_stops_the_engine_core_process(model_dir):
    engine = await asyncio.to_thread(AsyncEngine.from_args, str(model_dir("llama")), **ENGINE)
    pid, folder = engine.process.pid, engine.process.folder
    assert (await _final(engine)).finished
    await engine.shutdown()
    assert not alive(pid) and not folder.exists()


def test_the_child_command_carries_the_engine_arguments():
    from pagestream.engine_args import EngineArgs
    from pagestream.engine_core_process import EngineCoreProcess

    process = EngineCoreProcess(EngineArgs(model="m", max_num_seqs=7, dtype="float32"))
    try:
        argv = process.command()
    finally:
        process.close()
    assert argv[argv.index("scheduler") + 1] == "m"
    assert argv[argv.index("--host") + 1] == process.address
    assert process.address.startswith("unix:")
    assert argv[argv.index("--max-num-seqs") + 1] == "7"
    assert argv[argv.index("--dtype") + 1] == "float32"
    # The Python API's unbounded queue, not the CLI's serving default; given once.
    assert argv.count("--max-waiting-requests") == 1
    assert argv[argv.index("--max-waiting-requests") + 1] == "0"


def test_restarts_give_up_past_the_limit():
    from pagestream.engine_args import EngineArgs
    from pagestream.engine_core_process import EngineCoreProcess
    from services.common.supervisor import CHILD_BACKOFF

    process = EngineCoreProcess(EngineArgs(model="m"), max_restarts=3)
    try:
        delays = [process.supervisor.restart_delay(process.child) for _ in range(4)]
    finally:
        process.close()
    assert delays == [*CHILD_BACKOFF.steps[:3], None]
    assert process.gave_up is not None and "4 times" in process.gave_up
