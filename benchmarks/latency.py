"""Time per output token at small batches: `pagestream bench latency`.

Each dtype at batch 1 / 4 / 16 on the A/B driver (float32 the baseline), the weight-streaming
limit and llama.cpp at batch 1 on the same weights."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.ab_driver import ABDriver, ABWorkload, Variant
from benchmarks.micro import read_bandwidth_gb_s
from benchmarks.workload import BenchRequest

logger = logging.getLogger(__name__)

LLAMACPP_DTYPES = {"float32": "F32", "bfloat16": "BF16"}


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
    """What one decode step reads: every linear weight and the LM head once, in the run's
    dtype or quantized form (a GGUF file's matrices as it stores them)."""
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


def variant(dtype: str, options: LatencyOptions) -> Variant:
    """The model's own GGUF file, the float folder quantized at load, or in a dtype."""
    engine = {"dtype": dtype}
    if dtype == "gguf":
        engine = {"model": options.model, "quantization": "gguf", "dtype": "auto"}
    elif dtype in ("int8", "int4"):
        engine = {"quantization": dtype, "dtype": "auto"}
    return Variant(dtype, engine, {"dtype": dtype})


def measure_llamacpp(options: LatencyOptions, dtype: str) -> dict:
    """llama.cpp at batch 1: the very file pagestream runs for gguf, else an export."""
    from benchmarks.gguf_export import export_gguf, source_gguf
    from benchmarks.llamacpp import LlamaCppEngine, LlamaCppOptions, llama_cpp_version

    path = source_gguf(options.model)
    gguf_dtype = path.stem.rsplit(".", 1)[-1]
    if dtype != "gguf":
        gguf_dtype = LLAMACPP_DTYPES[dtype]
        path = export_gguf(path, gguf_dtype)
    kv_type = "BF16" if dtype == "gguf" else gguf_dtype  # the gguf run's cache: bfloat16
    prompt = _prompt(options.prompt_len)
    rounds = []
    cpp_options = LlamaCppOptions(model=options.model, dtypes=(kv_type,))
    max_len = options.prompt_len + options.output_len
    with LlamaCppEngine(path, kv_type, cpp_options, max_len, 1) as engine:
        engine.warm_up(BenchRequest(prompt, 4))
        for _ in range(options.rounds):
            seconds = []
            for output_len in (1, options.output_len):
                start = time.perf_counter()
                engine.generate([BenchRequest(prompt, output_len)])
                seconds.append(time.perf_counter() - start)
            rounds.append(round((seconds[1] - seconds[0]) / (options.output_len - 1) * 1e3, 2))
    logger.info("llama.cpp %s batch 1: %s ms/token", gguf_dtype, rounds)
    return {
        "ms_per_token": statistics.median(rounds),
        "ms_per_token_per_round": rounds,
        "gguf": path.name,
        "llama_cpp_python": llama_cpp_version(),
    }


def run_latency(options: LatencyOptions) -> dict:
    """Every dtype at each batch, llama.cpp at batch 1, the streaming limit. The read
    bandwidth of a shared machine drifts, so it is read before and after each engine's runs
    and the limit takes the highest reading."""
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
