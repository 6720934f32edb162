"""Load time, resident memory and batch-1 time per token of one model file, pagestream
beside llama.cpp on the same file and threads.

    python -m benchmarks.load FILE.gguf [--llama-bin DIR] [--repeats 3] [--tokens 64]
Fresh processes, one at a time, medians of `repeats`: pagestream's `LLM(model=FILE)` and
llama-server (until /health answers) with VmRSS then and the load's peak (VmHWM); ms per
token from greedy runs of 1 and `tokens` tokens and `llama-bench`; `--batch N`: tokens/s of
N prompts vs llama-batched-bench.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

_CHILD = """
import json, sys, time
start = time.perf_counter()
from pagestream import LLM, SamplingParams
imported = time.perf_counter()
llm = LLM(model=sys.argv[1], max_model_len=4096)
ready = time.perf_counter()
def rss(key="VmRSS:"):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
resident, peak = rss(), rss("VmHWM:")
tokens = int(sys.argv[2])
def timed(n):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(["Write a story about a fox."], params, use_tqdm=False)
    return time.perf_counter() - t
timed(2)
one, many = timed(1), timed(tokens)
print(json.dumps({"import_s": imported - start, "load_s": ready - imported,
                  "rss_bytes": resident, "peak_rss_bytes": peak, "rss_after_bytes": rss(),
                  "ms_per_token": 1000 * (many - one) / (tokens - 1)}))
"""

_BATCH_CHILD = """
import json, random, sys, time
from pagestream import LLM, SamplingParams
model, batch, prompt_len, tokens = sys.argv[1], *map(int, sys.argv[2:5])
llm = LLM(model=model, max_model_len=4096, max_num_seqs=batch)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(prompt_len)]}
           for _ in range(batch)]
params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
llm.engine.scheduler.kv.reset_prefix_cache()
start = time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
print(json.dumps({"tokens_per_s": batch * tokens / (time.perf_counter() - start)}))
"""


def _run(command: list, binary: Path | None = None) -> str:
    """The stdout of ``command``; a llama.cpp ``binary`` finds its libraries beside it."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent)) if binary else None
    return subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout


def pagestream_run(model: Path, tokens: int) -> dict:
    out = _run([sys.executable, "-c", _CHILD, str(model), str(tokens)])
    return json.loads(out.strip().splitlines()[-1])


def pagestream_batch_run(model: Path, batch: int, prompt_len: int, tokens: int) -> dict:
    sizes = map(str, (batch, prompt_len, tokens))
    out = _run([sys.executable, "-c", _BATCH_CHILD, str(model), *sizes])
    return json.loads(out.strip().splitlines()[-1])


def llama_batched_run(binary: Path, model: Path, threads: int, shape: tuple[int, int, int]):
    """llama-batched-bench's generated tokens per second over one run of `batch`
    sequences (prefill included), and its decode-only rate."""
    batch, prompt_len, tokens = shape
    context = batch * (prompt_len + tokens) + 64
    command = [binary, "-m", model, "-t", threads, "-c", context, "-npp", prompt_len]
    command += ["-ntg", tokens, "-npl", batch, "--output-format", "jsonl"]
    out = _run(list(map(str, command)), binary)
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return {"tokens_per_s": batch * tokens / row["t"], "decode_tokens_per_s": row["speed_tg"]}


def llama_server_run(binary: Path, model: Path, threads: int, port: int = 18765) -> dict:
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    command = [binary, "-m", model, "-t", threads, "--port", port, "-c", 4096]
    start = time.perf_counter()
    out = subprocess.DEVNULL
    server = subprocess.Popen(list(map(str, command)), env=env, stdout=out, stderr=out)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"llama-server exited ({server.returncode})") from None
                time.sleep(0.05)
        with open(f"/proc/{server.pid}/status") as status:
            kib = {line.split(":")[0]: int(line.split()[1]) for line in status if "kB" in line}
        return {
            "load_s": time.perf_counter() - start,
            "rss_bytes": kib["VmRSS"] * 1024,
            "peak_rss_bytes": kib["VmHWM"] * 1024,
        }
    finally:
        server.terminate()
        server.wait(timeout=30)


def llama_bench_ms_per_token(binary: Path, model: Path, threads: int, tokens: int) -> float:
    command = [binary, "-m", model, "-t", threads, "-p", 0, "-n", tokens, "-o", "json", "-r", 3]
    (result,) = json.loads(_run(list(map(str, command)), binary))
    return 1000.0 / float(result["avg_ts"])


def median_of(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--llama-bin", type=Path, help="llama.cpp's build/bin folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--cold", action="store_true", help="time a first start first")
    parser.add_argument("--batch", type=int, default=0, help="offline throughput at N too")
    parser.add_argument("--prompt-len", type=int, default=128)
    args = parser.parse_args(argv)
    model, bin_dir, threads, repeats = args.model, args.llama_bin, args.threads, args.repeats
    report: dict = {"model": str(model), "file_bytes": model.stat().st_size}
    if args.cold:
        from services.common.model_source import _converted_dir_for

        shutil.rmtree(_converted_dir_for(model), ignore_errors=True)
        report["pagestream_first_start"] = pagestream_run(model, args.tokens)
    report["pagestream"] = median_of([pagestream_run(model, args.tokens) for _ in range(repeats)])
    if bin_dir is not None:
        server = bin_dir / "llama-server"
        try:
            runs = [llama_server_run(server, model, threads) for _ in range(repeats)]
            report["llama_server"] = median_of(runs)
        except RuntimeError as exc:  # its figures are left out, llama-bench's still run
            report["llama_server"] = {"error": str(exc)}
        report["llama_bench_ms_per_token"] = llama_bench_ms_per_token(
            bin_dir / "llama-bench", model, threads, args.tokens
        )
    if args.batch:
        shape = (args.batch, args.prompt_len, args.tokens)
        runs = [pagestream_batch_run(model, *shape) for _ in range(repeats)]
        report["pagestream_batch"] = median_of(runs)
        if bin_dir is not None:
            binary = bin_dir / "llama-batched-bench"
            runs = [llama_batched_run(binary, model, threads, shape) for _ in range(repeats)]
            report["llama_batched"] = median_of(runs)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
