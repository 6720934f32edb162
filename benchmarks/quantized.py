"""A GGUF file as it is, against llama.cpp on the very same file: `pagestream bench quantized`.

Both beside pagestream on the de-quantized weights; greedy agreement with its float32 run."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from benchmarks.ab_driver import ABDriver, ABWorkload, Variant, ab_row
from benchmarks.results import ratio
from benchmarks.workload import BenchRequest

QUANTIZE_ENV = "LLAMA_QUANTIZE"


@dataclass(frozen=True)
class QuantizedOptions:
    model: str  # a GGUF model: an alias, a .gguf file or a folder holding one
    kv_cache_memory: str = "2GiB"
    seqs: int = 32  # llama.cpp's parallel sequences
    llama_quantize: str | None = None  # llama-quantize, for the Q8_0 runs


def llama_quantized(source: Path, llama_quantize: str | None, file_type: str) -> Path | None:
    """A `file_type` ("Q8_0", "Q4_0", ...) file of `source`'s weights, made once next to it
    by llama-quantize from its F32 export (the binary's folder first on LD_LIBRARY_PATH);
    None where it was not made and there is no llama-quantize to make it."""
    from benchmarks.gguf_export import export_gguf

    out = source.with_name(f"{source.stem}.{file_type}.gguf")
    if out.is_file() and out.stat().st_mtime >= source.stat().st_mtime:
        return out
    if not llama_quantize:
        return None
    f32 = export_gguf(source, "F32")
    tmp = out.with_name(out.name + ".tmp")
    env = dict(os.environ)
    libs = [str(Path(llama_quantize).resolve().parent), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs if p)
    command = [llama_quantize, str(f32), str(tmp), file_type]
    subprocess.run(command, check=True, capture_output=True, env=env)
    tmp.rename(out)
    return out


def _label(path: Path) -> str:
    return path.stem.rsplit(".", 1)[-1]


def variants(files: list[Path], floats: str) -> list[Variant]:
    """pagestream float32 on the de-quantized weights (the baseline), bfloat16 on them, and
    each GGUF file with its blocks kept (dtype auto: a bfloat16 KV cache)."""
    found = [
        Variant(f"pagestream LLM.generate ({d}, de-quantized)", {"model": floats, "dtype": d})
        for d in ("float32", "bfloat16")
    ]
    for path in files:
        engine = {"model": str(path), "dtype": "auto", "quantization": "gguf"}
        found.append(Variant(f"pagestream LLM.generate ({_label(path)} blocks)", engine))
    return found


def llamacpp_row(path: Path, requests, options: QuantizedOptions, baseline: list[dict]) -> dict:
    """llama.cpp on one GGUF file (bfloat16 KV cache), a row against pagestream float32."""
    from benchmarks.llamacpp import LlamaCppOptions, run_llamacpp

    cpp_options = LlamaCppOptions(model=str(path), dtypes=("BF16",), seqs=(options.seqs,))
    run, tokens = run_llamacpp(requests, path, "BF16", options.seqs, cpp_options)
    timed = {"elapsed_s": run.elapsed_s, "output_tokens": run.output_tokens, "tpot_ms": None}
    name = f"llama.cpp {_label(path)} ({options.seqs} seqs)"
    return ab_row(name, "default", None, [{**timed, "token_ids": tokens}], baseline, run.extra)


def run_quantized(requests: list[BenchRequest], options: QuantizedOptions) -> dict:
    from benchmarks.gguf_export import source_gguf
    from services.worker.models.gguf_weights import dequantized_folder

    source = source_gguf(options.model)
    files = [source]
    quantize = options.llama_quantize or os.environ.get(QUANTIZE_ENV)
    if quantize:
        files.append(llama_quantized(source, quantize, "Q8_0"))
    floats = str(dequantized_folder(options.model))
    workload = ABWorkload("default", requests)
    driver = ABDriver(floats, [workload], 1, "float32", options.kv_cache_memory)
    runs = driver.run(variants(files, floats))
    for row in runs:
        row |= driver.engines[row["variant"]]  # dtype, quantization, weight_bytes
    baseline = driver.found[(runs[0]["variant"], "default", None)]
    theirs = [llamacpp_row(path, requests, options, baseline) for path in files]
    ratios = {
        f"{ours['variant']} / {cpp['variant']}": ratio(ours["output_tok_s"], cpp["output_tok_s"], 2)
        for ours, cpp in zip(runs[2:], theirs, strict=True)
    }
    return {"runs": runs + theirs, "ratios": ratios, "source_gguf": source.name}
