"""Time per output token at small batches: `pagestream bench latency`.

One chat's speed, as a llama.cpp user compares it: a prompt of `prompt_len` tokens, then
`output_len` greedy tokens (ignore_eos), batch 1, 4 and 16 copies of it, each dtype a variant
on the A/B driver (benchmarks/ab_driver.py; float32 the baseline): its TPOT is the time per
output token of the decode part alone (per request, first to last token over its tokens - 1),
medians over `rounds` rounds that take turns.

Beside it: the weight-streaming limit (the bytes a decode step must read, every linear weight
and the LM head once, over the read bandwidth measured here by summing a 1 GiB float32
tensor on the same threads) and, with the bench extra installed, llama.cpp at batch 1 on the
same weights (F32 / BF16 GGUF files exported from the model's GGUF, benchmarks/gguf_export.py),
threads and prompt, timed as (time for output_len tokens - time for 1) / (output_len - 1).

Quantized runs beside the float ones: "gguf" runs the model's own GGUF file as it is (its
Q4_1 / Q8_0 blocks, `quantization="gguf"`), and llama.cpp runs that very file; "int8" /
"int4" quantize the float checkpoint at load. Their streaming limit counts the bytes they
really read: the file's matrix bytes (the tied embedding once, as the LM head), or the
codes and scales of int8 / int4.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.ab_driver import ABDriver
from benchmarks.ab_workload import ABWorkload
from benchmarks.micro import read_bandwidth_gb_s
from benchmarks.variant import Variant
from benchmarks.workload import BenchRequest

logger = logging.getLogger(__name__)

LLAMACPP_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
QUANTIZED_RUNS = ("gguf", "int8", "int4")


@dataclass(frozen=True)
class LatencyOptions:
    model: str  # the model's name or path (llama.cpp's GGUF is exported from its GGUF)
    folder: str  # its resolved HF folder (what pagestream loads)
    kv_cache_memory: str
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "int8", "gguf")  # the first: baseline
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    prompt_len: int = 200
    output_len: int = 128
    rounds: int = 3
    llamacpp: bool = True

    def __post_init__(self) -> None:
        if self.output_len < 2 or self.prompt_len < 1 or self.rounds < 1:
            raise ValueError("output_len >= 2, prompt_len >= 1 and rounds >= 1 are needed.")


def decode_bytes(folder: str, dtype: str, model: str = "") -> int:
    """What one decode step must read: every linear weight of the stack and the LM head
    once, in the run's dtype or quantized form (the embedding rows it gathers are a few KB)."""
    from benchmarks.ceiling import ModelShapes

    if dtype == "gguf":
        return gguf_matrix_bytes(model)
    shapes = ModelShapes.of(folder)
    weights = shapes.num_layers * sum(i * o for i, o in shapes.layer_linears())
    weights += shapes.vocab_size * shapes.hidden_size
    if dtype == "int8":  # a byte per weight and a float32 scale per output channel
        return weights
    if dtype == "int4":  # half a byte per weight, float32 scale and min per 128
        return weights // 2 + weights // 128 * 8
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size() * weights


def gguf_matrix_bytes(model: str) -> int:
    """The bytes of a GGUF model's matrices as the file stores them (norms left out)."""
    from gguf import GGUFReader

    from services.common.model_source import gguf_source

    reader = GGUFReader(str(gguf_source(model)))
    return sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 2)


def _prompt(prompt_len: int) -> list[int]:
    return [1000 + (i * 37) % 20000 for i in range(prompt_len)]


def _per_token_ms(full_s: float, first_s: float, output_len: int) -> float:
    return (full_s - first_s) / (output_len - 1) * 1e3


def variant(dtype: str, options: LatencyOptions) -> Variant:
    """A dtype's engine: the model's own GGUF file with its blocks kept, the float folder
    quantized at load (int8 / int4) or in a dtype."""
    if dtype == "gguf":
        engine = {"model": options.model, "quantization": "gguf", "dtype": "auto"}
    elif dtype in QUANTIZED_RUNS:
        engine = {"quantization": dtype, "dtype": "auto"}
    else:
        engine = {"dtype": dtype}
    return Variant(dtype, engine, {"dtype": dtype})


def measure_llamacpp(options: LatencyOptions, dtype: str) -> dict:
    from benchmarks.gguf_export import export_gguf, source_gguf
    from benchmarks.llamacpp import LlamaCppEngine, LlamaCppOptions, llama_cpp_version

    if dtype == "gguf":  # the very file pagestream runs
        path = source_gguf(options.model)
        gguf_dtype = path.stem.rsplit(".", 1)[-1]
    else:
        gguf_dtype = LLAMACPP_DTYPES[dtype]
        path = export_gguf(source_gguf(options.model), gguf_dtype)
    kv_type = "BF16" if dtype == "gguf" else gguf_dtype  # the gguf run's cache: bfloat16
    cpp_options = LlamaCppOptions(model=options.model, dtypes=(kv_type,))
    prompt = _prompt(options.prompt_len)
    max_len = options.prompt_len + options.output_len
    rounds = []
    with LlamaCppEngine(path, kv_type, cpp_options, max_len, 1) as engine:
        engine.warm_up(BenchRequest(prompt, 4))
        for _ in range(options.rounds):
            start = time.perf_counter()
            engine.generate([BenchRequest(prompt, 1)])
            first = time.perf_counter() - start
            start = time.perf_counter()
            engine.generate([BenchRequest(prompt, options.output_len)])
            full = time.perf_counter() - start
            rounds.append(round(_per_token_ms(full, first, options.output_len), 2))
    logger.info("llama.cpp %s batch 1: %s ms/token", gguf_dtype, rounds)
    return {
        "ms_per_token": statistics.median(rounds),
        "ms_per_token_per_round": rounds,
        "gguf": path.name,
        "llama_cpp_python": llama_cpp_version(),
    }


def run_latency(options: LatencyOptions) -> dict:
    """Every dtype through pagestream at each batch, llama.cpp at batch 1, the streaming
    limit. The read bandwidth of a shared machine drifts (31-57 GB/s seen within minutes on
    the 2-core VM), so it is read before and after pagestream's runs and each llama.cpp
    run, and the limit takes the highest reading: the fastest the weights could have been
    streamed during the run."""
    readings = [read_bandwidth_gb_s()]
    prompt = BenchRequest(_prompt(options.prompt_len), options.output_len)
    batches = options.batch_sizes
    copies = ABWorkload("one prompt", [prompt] * max(batches), True, batches, num_requests=1)
    memory = options.kv_cache_memory
    driver = ABDriver(options.folder, [copies], options.rounds, "float32", memory, engine={})
    runs = driver.run([variant(d, options) for d in options.dtypes])
    readings.append(read_bandwidth_gb_s())
    part: dict = {
        "prompt_len": options.prompt_len,
        "output_len": options.output_len,
        "rounds": options.rounds,
        "threads": torch.get_num_threads(),
        "runs": runs,
        "dtypes": {},
    }
    batch1 = {r["variant"]: r["tpot_ms"] for r in runs if r["batch"] == min(batches)}
    for dtype in options.dtypes:
        entry: dict = {"decode_bytes": decode_bytes(options.folder, dtype, options.model)}
        if options.llamacpp and (dtype in LLAMACPP_DTYPES or dtype == "gguf"):
            theirs = measure_llamacpp(options, dtype)
            readings.append(read_bandwidth_gb_s())
            entry["llamacpp"] = theirs
            entry["llamacpp_over_ours"] = round(theirs["ms_per_token"] / batch1[dtype], 2)
        part["dtypes"][dtype] = entry
    bandwidth = max(readings)
    part["read_gb_s"] = [round(r, 1) for r in readings]
    for dtype, entry in part["dtypes"].items():
        limit_ms = entry["decode_bytes"] / (bandwidth * 1e9) * 1e3
        entry["streaming_limit_ms"] = round(limit_ms, 2)
        entry["batch1_over_limit"] = round(batch1[dtype] / limit_ms, 2)
    return part
