"""A GGUF model's own file as it is, against llama.cpp on the very same file:
`pagestream bench quantized`.

Offline throughput on the profile's workload (every engine gets the same prompts and output
lengths, ignore_eos): pagestream with the file's blocks kept (`quantization="gguf"`, dtype
auto: a bfloat16 KV cache) and llama.cpp on that file with `seqs` sequences in parallel (a
bfloat16 KV cache too), one engine at a time. With `$LLAMA_QUANTIZE` (llama.cpp's
llama-quantize), a Q8_0 file made from the F32 export of the same weights runs both ways as
well.

Beside them, pagestream bfloat16 on the de-quantized weights: what the file ran as before
its blocks were kept (the float model in bfloat16, not quantized).

Greedy agreement of each run with pagestream float32 on the de-quantized weights of the
same file (the float model those blocks stand for), over the whole workload: equal
requests, the mean first difference, as benchmarks/results.py counts them. llama.cpp
rounds its activations to 8 bits inside the quantized dot products; pagestream does the
same on the bfloat16 VNNI path (pagestream_kernels/cpu/quantized_linear.cpp).
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from benchmarks.ab_driver import ABDriver
from benchmarks.ab_workload import ABWorkload
from benchmarks.results import ratio
from benchmarks.row import Row
from benchmarks.variant import Variant
from benchmarks.workload import BenchRequest

logger = logging.getLogger(__name__)

QUANTIZE_ENV = "LLAMA_QUANTIZE"


@dataclass(frozen=True)
class QuantizedOptions:
    model: str  # a GGUF model: an alias, a .gguf file or a folder holding one
    kv_cache_memory: str = "2GiB"
    seqs: int = 32  # llama.cpp's parallel sequences
    llama_quantize: str | None = None  # llama-quantize, for the Q8_0 runs


def make_q8_0(source: Path, llama_quantize: str) -> Path:
    """A Q8_0 file of `source`'s weights (from its F32 export), made once next to it."""
    return llama_quantized(source, llama_quantize, "Q8_0")


def llama_quantized_path(source: Path, file_type: str) -> Path:
    """Where llama_quantized keeps `source`'s `file_type` file: next to it."""
    return source.with_name(f"{source.stem}.{file_type}.gguf")


def is_made(path: Path, source: Path) -> bool:
    """`path` was made (no earlier than `source`), so it need not be made again."""
    return path.is_file() and path.stat().st_mtime >= source.stat().st_mtime


def llama_quantized(source: Path, llama_quantize: str, file_type: str) -> Path:
    """A `file_type` ("Q8_0", "Q4_0", ... as llama-quantize names them) file of `source`'s
    weights, quantized by llama-quantize from its F32 export, made once next to it. The
    binary's own folder goes first on LD_LIBRARY_PATH (its shared libraries live there)."""
    from benchmarks.gguf_export import export_gguf

    out = llama_quantized_path(source, file_type)
    if is_made(out, source):
        return out
    f32 = export_gguf(source, "F32")
    tmp = out.with_name(out.name + ".tmp")
    env = dict(os.environ)
    libs = [str(Path(llama_quantize).resolve().parent), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs if p)
    command = [llama_quantize, str(f32), str(tmp), file_type]
    subprocess.run(command, check=True, capture_output=True, env=env)
    tmp.rename(out)
    return out


def variants(source: Path, files: list[Path], floats: str) -> list[Variant]:
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


def _label(path: Path) -> str:
    return path.stem.rsplit(".", 1)[-1]


def llamacpp_row(path: Path, requests, options: QuantizedOptions, baseline: list[dict]) -> dict:
    """llama.cpp on one GGUF file (bfloat16 KV cache), a row against pagestream float32."""
    from benchmarks.llamacpp import LlamaCppOptions, run_llamacpp

    cpp_options = LlamaCppOptions(model=str(path), dtypes=("BF16",), seqs=(options.seqs,))
    run, tokens = run_llamacpp(requests, path, "BF16", options.seqs, cpp_options)
    timed = {"elapsed_s": run.elapsed_s, "output_tokens": run.output_tokens, "tpot_ms": None}
    name = f"llama.cpp {_label(path)} ({options.seqs} seqs)"
    row = Row.of(name, "default", None, [{**timed, "token_ids": tokens}], baseline, run.extra)
    return row.as_dict()


def run_quantized(requests: list[BenchRequest], options: QuantizedOptions) -> dict:
    from benchmarks.gguf_export import source_gguf
    from services.worker.models.gguf_weights import dequantized_folder

    source = source_gguf(options.model)
    files = [source]
    quantize = options.llama_quantize or os.environ.get(QUANTIZE_ENV)
    if quantize:
        files.append(make_q8_0(source, quantize))
    floats = str(dequantized_folder(options.model))
    driver = ABDriver(
        floats, [ABWorkload("default", requests)], 1, "float32", options.kv_cache_memory
    )
    runs = driver.run(variants(source, files, floats))
    for row in runs:
        row |= driver.engines[row["variant"]]  # dtype, quantization, weight_bytes
    baseline = driver.found[(runs[0]["variant"], "default", None)]
    theirs = [llamacpp_row(path, requests, options, baseline) for path in files]
    ratios = {
        f"{ours['variant']} / {cpp['variant']}": ratio(ours["output_tok_s"], cpp["output_tok_s"], 2)
        for ours, cpp in zip(runs[2:], theirs, strict=True)
    }
    return {"runs": runs + theirs, "ratios": ratios, "source_gguf": source.name}
