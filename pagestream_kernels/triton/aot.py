"""Ahead-of-time compile of every kernel configuration the worker uses, for sm_90 (H100/H200).

Needs no GPU: ``triton.compile`` with ``GPUTarget("cuda", 90, 32)`` runs Triton's bundled
LLVM and ptxas. The launches are built by the same `pagestream_kernels.triton.launch` functions the
worker calls, on meta tensors, so the signatures, constexprs and options are exactly those a
real run would compile (pointer and multiple-of-16 integer specialisation mirrored).
Resource usage comes from the cubin (``cuobjdump -res-usage``): registers, stack / local
bytes (spills) and static shared memory, plus the dynamic shared memory Triton requests.

    .venv/bin/python -m pagestream_kernels.triton.aot    # prints one line per configuration
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagestream_kernels.attention_metadata import AttentionMetadata
from pagestream_kernels.triton.launch import (
    KernelLaunch,
    paged_attention_launches,
    reshape_and_cache_launches,
)

logger = logging.getLogger(__name__)

SM90 = GPUTarget("cuda", 90, 32)
# Largest dynamic shared memory one block may use on sm_90 (227 KiB).
SM90_MAX_SHARED_BYTES = 227 * 1024
_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4m3",
    torch.float8_e5m2: "fp8e5m2",
}
_TRITON_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e5m2: "*fp8e5",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


@dataclass(frozen=True)
class WorkerShape:
    """One model geometry the worker may serve."""

    dtype: torch.dtype
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    block_size: int = 16
    sliding_window: int | None = None
    soft_cap: float | None = None
    cache_dtype: torch.dtype | None = None  # the KV cache's, when not `dtype` (fp8)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.cache_dtype or self.dtype


@dataclass(frozen=True)
class CompiledConfig:
    """Resource usage of one compiled kernel configuration."""

    label: str
    registers: int
    stack_bytes: int
    local_bytes: int
    shared_bytes: int  # Triton's dynamic shared memory plus any static shared memory
    num_warps: int
    num_stages: int

    @property
    def spills(self) -> bool:
        return self.stack_bytes > 0 or self.local_bytes > 0

    def line(self) -> str:
        return (
            f"{self.label:72s} regs {self.registers:3d}  stack {self.stack_bytes:4d} B  "
            f"local {self.local_bytes:4d} B  smem {self.shared_bytes / 1024:6.1f} KiB  "
            f"warps {self.num_warps}  stages {self.num_stages}"
        )


def worker_shapes() -> list[WorkerShape]:
    """Geometries of the served model families, every dtype the worker runs on CUDA.

    Llama-3-8B (32/8 x 128), Llama-3.2-1B/SmolLM (GQA, 64-dim heads), MHA (group 1),
    a wide GQA group of 8, block size 32, sliding-window (Mistral/Qwen2) and soft-cap with
    256-dim heads (Gemma-2 through the HF fallback); fp8 caches (--kv-cache-dtype fp8_e4m3 /
    fp8_e5m2) under bf16 and fp16 models.
    """
    shapes = [
        WorkerShape(dtype, head_dim, 32, 8)
        for dtype in (torch.bfloat16, torch.float16, torch.float32)
        for head_dim in (128, 64)
    ]
    shapes += [
        WorkerShape(torch.bfloat16, 128, 32, 8, block_size=32),
        WorkerShape(torch.float32, 128, 32, 8, block_size=32),
        WorkerShape(torch.bfloat16, 128, 32, 32),  # MHA: group_size 1 specialises
        WorkerShape(torch.bfloat16, 64, 9, 3),  # SmolLM2-135M: 9 heads, 3 kv heads
        WorkerShape(torch.bfloat16, 128, 64, 8),  # group 8
        WorkerShape(torch.bfloat16, 128, 32, 8, sliding_window=4096),
        WorkerShape(torch.bfloat16, 256, 16, 8, sliding_window=4096, soft_cap=50.0),
        WorkerShape(torch.bfloat16, 256, 16, 8),
        WorkerShape(torch.bfloat16, 128, 32, 8, cache_dtype=torch.float8_e4m3fn),
        WorkerShape(torch.bfloat16, 64, 32, 8, cache_dtype=torch.float8_e5m2),
        WorkerShape(torch.float16, 128, 32, 8, cache_dtype=torch.float8_e4m3fn),
    ]
    return shapes


def shape_launches(shape: WorkerShape) -> Iterator[tuple[str, KernelLaunch]]:
    """Every launch the worker makes for `shape`: cache write, prefill, decode, split decode."""
    meta = torch.device("meta")
    num_seqs, prefill_tokens = 64, 2048
    kv_cache = torch.empty(
        (2, 4096, shape.block_size, shape.num_kv_heads, shape.head_dim),
        dtype=shape.kv_dtype,
        device=meta,
    )
    name = (
        f"{_DTYPE_NAMES[shape.dtype]} hd{shape.head_dim} {shape.num_q_heads}/{shape.num_kv_heads}"
    )
    name += f" kv {_DTYPE_NAMES[shape.cache_dtype]}" if shape.cache_dtype else ""
    name += f" bs{shape.block_size}"
    name += " window" if shape.sliding_window else ""
    name += " softcap" if shape.soft_cap else ""
    key = torch.empty(
        (prefill_tokens, shape.num_kv_heads, shape.head_dim), dtype=shape.dtype, device=meta
    )
    slots = torch.empty(prefill_tokens, dtype=torch.int64, device=meta)
    for launch in reshape_and_cache_launches(key, key, kv_cache, slots):
        yield f"reshape_and_cache {name}", launch
    batches = (("prefill", prefill_tokens, 2048, None), ("decode", num_seqs, 1, False))
    batches += (("decode split", num_seqs, 1, True),)
    for kind, num_tokens, max_query_len, split in batches:
        query = torch.empty(
            (num_tokens, shape.num_q_heads, shape.head_dim), dtype=shape.dtype, device=meta
        )
        metadata = AttentionMetadata(
            slot_mapping=torch.empty(num_tokens, dtype=torch.int64, device=meta),
            block_table=torch.empty((num_seqs, 512), dtype=torch.int32, device=meta),
            seq_lens=torch.empty(num_seqs, dtype=torch.int32, device=meta),
            query_start_loc=torch.empty(num_seqs + 1, dtype=torch.int32, device=meta),
            max_query_len=max_query_len,
            max_seq_len=4096,
        )
        launches = paged_attention_launches(
            query,
            kv_cache,
            metadata,
            shape.head_dim**-0.5,
            sliding_window=shape.sliding_window,
            soft_cap=shape.soft_cap,
            split_kv=split,
            out=torch.empty_like(query),
        )
        for launch in launches:
            yield f"{launch.kernel.__name__.removesuffix('_kernel')} {kind} {name}", launch


def _source(launch: KernelLaunch) -> ASTSource:
    """The ASTSource a runtime launch of `launch` would compile (Triton's specialisation)."""
    kernel = launch.kernel
    signature: dict[str, str] = {}
    constexprs = dict(launch.constexprs)
    attrs: dict[tuple[int, ...], list] = {}
    no_specialise = set(getattr(kernel, "do_not_specialize", None) or ())
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = launch.args[name]
        if isinstance(value, torch.Tensor):
            signature[name] = _TRITON_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1 and name not in no_specialise and index not in no_specialise:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i64" if name.startswith("stride_") else "i32"
            if value % 16 == 0 and name not in no_specialise and index not in no_specialise:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)


def _tool(name: str) -> str:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(bundled) if bundled.exists() else name


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """REG / STACK / LOCAL / SHARED of the cubin's one kernel, from ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", handle.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    usage = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text.split("Function", 1)[1]))
    return {field: int(value) for field, value in usage.items()}


def compile_launch(label: str, launch: KernelLaunch, target: GPUTarget = SM90) -> CompiledConfig:
    """Compile one launch for `target` and read its resource usage."""
    compiled = triton.compile(
        _source(launch),
        target=target,
        options={"num_warps": launch.num_warps, "num_stages": launch.num_stages},
    )
    usage = _resource_usage(compiled.asm["cubin"])
    return CompiledConfig(
        label=label,
        registers=usage["REG"],
        stack_bytes=usage["STACK"],
        local_bytes=usage["LOCAL"],
        shared_bytes=compiled.metadata.shared + usage["SHARED"],
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )


@functools.cache
def worker_configurations() -> dict[str, KernelLaunch]:
    """Distinct compiled configurations (same kernel, signature and constexprs count once)."""
    unique: dict[str, KernelLaunch] = {}
    seen: set[str] = set()
    for shape in worker_shapes():
        for label, launch in shape_launches(shape):
            source = _source(launch)
            key = f"{source.hash()}-{launch.num_warps}-{launch.num_stages}"
            if key not in seen:
                seen.add(key)
                unique[label] = launch
    return unique


def _compile_by_label(label: str) -> CompiledConfig:
    return compile_launch(label, worker_configurations()[label])


def compile_all(workers: int | None = None) -> list[CompiledConfig]:
    """Compile every worker configuration for sm_90, in `workers` processes (default: CPUs)."""
    labels = list(worker_configurations())
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        results = [_compile_by_label(label) for label in labels]
    else:
        context = multiprocessing.get_context("spawn")  # no forked torch / triton state
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            results = list(pool.map(_compile_by_label, labels))
    for result in results:
        logger.info("%s", result.line())
    return results


def main() -> None:
    for result in compile_all():
        print(result.line())


if __name__ == "__main__":
    main()
