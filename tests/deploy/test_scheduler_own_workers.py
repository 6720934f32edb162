"""`pagestream scheduler MODEL` without --worker starts its own worker (here `uni`, in its
process): one data-parallel replica as one command. Served through a frontend over gRPC,
its greedy outputs equal the offline engine's, and SIGTERM stops it cleanly."""

import signal
import subprocess

from pagestream import LLM, SamplingParams
from services.frontend.frontend_server import connect_frontend
from services.frontend.tokenizer import load_tokenizer
from tests.helpers.processes import START_TIMEOUT_S, cli, free_port, wait_serving

PROMPT = [5, 17, 33, 99, 250, 12, 8, 41]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


async def test_a_scheduler_with_its_own_worker_serves_like_the_engine(model_dir):
    folder = model_dir("llama")
    expected = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB").generate(
        {"prompt_token_ids": PROMPT}, PARAMS, use_tqdm=False
    )[0]
    port = free_port()
    argv = cli(
        "--log-level", "WARNING", "scheduler", str(folder), "--port", str(port),
        "--dtype", "float32", "--kv-cache-memory", "8MiB", "--swap-space", "0.01",
    )  # fmt: skip
    process = subprocess.Popen(argv)
    try:
        wait_serving(f"127.0.0.1:{port}", [process], START_TIMEOUT_S)
        frontend = await connect_frontend(f"127.0.0.1:{port}", load_tokenizer(folder))
        try:
            request = {"prompt_token_ids": PROMPT}
            outputs = [o async for o in frontend.generate(request, PARAMS)]
        finally:
            await frontend.close()
        assert outputs[-1].outputs[0].token_ids == expected.outputs[0].token_ids
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
