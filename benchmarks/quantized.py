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

import dataclasses
import gc
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

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


def _pagestream(model: str, requests: list[BenchRequest], name: str, **engine) -> tuple:
    from benchmarks.offline import run_pagestream
    from pagestream import LLM

    llm = LLM(model, **engine)
    info = llm.engine.model_info
    run = run_pagestream(llm, requests, name)
    run.extra["quantization"], run.extra["weight_bytes"] = info.quantization, info.weight_bytes
    run.extra.pop("kv_utilization", None)  # the throughput section reports it
    del llm
    gc.collect()
    return run


def _file_runs(path: Path, requests, options: QuantizedOptions, reference) -> tuple[list, dict]:
    """pagestream and llama.cpp on one GGUF file, and their agreement with `reference`."""
    from benchmarks.llamacpp import LlamaCppOptions, full_agreement, run_llamacpp

    label = path.stem.rsplit(".", 1)[-1]
    ours = _pagestream(
        str(path),
        requests,
        f"pagestream LLM.generate ({label} blocks)",
        quantization="gguf",
        kv_cache_memory=options.kv_cache_memory,
    )
    cpp_options = LlamaCppOptions(model=str(path), dtypes=("BF16",), seqs=(options.seqs,))
    theirs, tokens = run_llamacpp(requests, path, "BF16", options.seqs, cpp_options)
    theirs = dataclasses.replace(theirs, name=f"llama.cpp {label} ({options.seqs} seqs)")
    agreement = {
        ours.name: full_agreement(ours.name, ours.token_ids, reference),
        theirs.name: full_agreement(theirs.name, tokens, reference),
    }
    return [ours, theirs], agreement


def run_quantized(requests: list[BenchRequest], options: QuantizedOptions) -> dict:
    from benchmarks.gguf_export import source_gguf
    from benchmarks.llamacpp import full_agreement
    from services.worker.models.gguf_weights import dequantized_folder

    source = source_gguf(options.model)
    floats = str(dequantized_folder(options.model))
    reference_run, bf16_run = (
        _pagestream(
            floats,
            requests,
            f"pagestream LLM.generate ({dtype}, de-quantized)",
            dtype=dtype,
            kv_cache_memory=options.kv_cache_memory,
        )
        for dtype in ("float32", "bfloat16")
    )
    reference = reference_run.token_ids
    files = [source]
    quantize = options.llama_quantize or os.environ.get(QUANTIZE_ENV)
    if quantize:
        files.append(make_q8_0(source, quantize))
    runs = [reference_run, bf16_run]
    agreement = {bf16_run.name: full_agreement(bf16_run.name, bf16_run.token_ids, reference)}
    for path in files:
        file_runs, file_agreement = _file_runs(path, requests, options, reference)
        runs += file_runs
        agreement.update(file_agreement)
    ratios = {
        f"{ours.name} / {theirs.name}": round(
            ours.output_tokens_per_s / theirs.output_tokens_per_s, 2
        )
        for ours, theirs in zip(runs[2::2], runs[3::2], strict=True)
    }
    return {
        "runs": [r.as_dict() for r in runs],
        "ratios": ratios,
        "agreement": agreement,
        "source_gguf": source.name,
    }
