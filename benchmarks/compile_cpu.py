"""torch.compile (inductor) on the CPU decode path: is it worth its compile time?

The forward cannot be compiled whole: the paged attention is a C++ extension call with
per-step planning in Python, a graph break in every layer. What inductor can take is the
rest of each decoder layer: the norms, the MLP (gate/up, activation, down) and the
residual adds, where it fuses the elementwise work around the matmuls. This compiles
those modules of every layer (dynamic shapes: the token count changes every step) and
times, eager against compiled, in one process:

  compile   the first steps' extra time (inductor codegen and C++ builds; cached in
            $TORCHINDUCTOR_CACHE_DIR for the next process)
  batch 1   ms per output token of one greedy request
  batch N   output tok/s of N requests from the benchmark workload

    .venv/bin/python -m benchmarks.compile_cpu [--dtype float32] [--batch 32]

Measured 2026-12-01 (2-core Zen 5 VM, torch 2.13, bfloat16, default model, --batch 32
--rounds 2): eager 21.3 ms per token at batch 1 and 301 output tok/s at batch 32; compiled
31.1 ms and 242 tok/s (x0.69 and x0.80), after 15 s of compiling. The eager path already
runs these modules as one C++ call each (kernels/cpu/fused.cpp) on prepacked weights,
which inductor cannot take; so torch.compile is not adopted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.throughput import make_llm, run_pagestream
from benchmarks.workload import PROFILES, make_workload
from services.common.config import DEFAULT_MODEL
from services.worker.layers.packed_weight import PACKED_ENV


def compile_layers(model: torch.nn.Module) -> int:
    """Compiles every decoder layer's norms and MLP in place; returns how many modules."""
    count = 0
    for layer in model.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            module = getattr(layer, name, None)
            if module is not None:
                setattr(layer, name, torch.compile(module, dynamic=True))
                count += 1
    return count


def batch1_ms_per_token(llm, prompt: list[int], tokens: int, rounds: int) -> float:
    from pagestream import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        times.append((time.perf_counter() - start) / tokens)
    return 1e3 * statistics.median(times)


def measure(folder: str, dtype: str, compiled: bool, requests, rounds: int) -> dict:
    # inductor cannot lower oneDNN's linear on a prepacked (opaque) weight: the compiled
    # model keeps plain weights, which inductor handles (and may pack) itself
    os.environ[PACKED_ENV] = "0" if compiled else "1"
    llm = make_llm(folder, dtype, "2GiB", enable_prefix_caching=False)
    result: dict = {"mode": "compiled" if compiled else "eager"}
    if compiled:
        compile_layers(llm.engine.worker.model)
        start = time.perf_counter()
        run_pagestream(llm, requests[:4])  # prefill and decode shapes: compiles both
        batch1_ms_per_token(llm, requests[0].prompt_token_ids, 4, 1)
        result["compile_s"] = round(time.perf_counter() - start, 1)
    result["batch1_ms_per_token"] = round(
        batch1_ms_per_token(llm, requests[0].prompt_token_ids, 64, rounds), 2
    )
    runs = [run_pagestream(llm, requests).output_tokens_per_s for _ in range(rounds)]
    result["batch_output_tokens_per_s"] = round(statistics.median(runs), 1)
    llm.engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    from transformers import AutoTokenizer

    from services.worker.models.gguf_weights import dequantized_folder

    folder = str(dequantized_folder(opts.model))
    workload = make_workload(AutoTokenizer.from_pretrained(folder), PROFILES["quick"])
    requests = workload.requests[: opts.batch]
    rows = [measure(folder, opts.dtype, c, requests, opts.rounds) for c in (False, True)]
    for row in rows:
        print(row, flush=True)
    eager, compiled = rows
    one = eager["batch1_ms_per_token"] / compiled["batch1_ms_per_token"]
    many = compiled["batch_output_tokens_per_s"] / eager["batch_output_tokens_per_s"]
    print(
        f"compiled / eager speed: batch 1 x{one:.3f}, batch {opts.batch} x{many:.3f}; "
        f"compile {compiled['compile_s']} s"
    )


if __name__ == "__main__":
    main()
