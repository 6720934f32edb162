"""What a model will take from the machine's memory when it loads, and what is free.

A model's footprint is its weight files' bytes (memory-mapped or read, either way resident
once it serves) plus its KV budget on the CPU (--kv-cache-memory, default 4 GiB; a CUDA
model's cache lives on the device and counts nothing here). What is free is the kernel's
MemAvailable (/proc/meminfo), or a --models-memory budget less what the loaded models take.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagestream.engine_args import EngineArgs
from services.common.config import parse_size
from services.common.model_source import gguf_source

GIB = 1024**3
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


@dataclass(frozen=True)
class Footprint:
    weight_bytes: int
    kv_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def describe(self) -> str:
        parts = f"weights {gib(self.weight_bytes)} + KV cache {gib(self.kv_bytes)}"
        return f"{gib(self.total)} ({parts})"


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def footprint(args: EngineArgs, mmproj: str | None = None) -> Footprint:
    return Footprint(weight_bytes(args.model) + _file_bytes(mmproj), kv_bytes(args))


def weight_bytes(model: str) -> int:
    """The bytes of a model's weight files: its GGUF file, or an HF folder's shards."""
    source = gguf_source(model)
    if source is not None:
        return _file_bytes(source)
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return 0  # the load itself says what is missing
    return sum(_file_bytes(p) for p in folder.iterdir() if p.suffix.lower() in WEIGHT_SUFFIXES)


def kv_bytes(args: EngineArgs) -> int:
    if args.device.startswith("cuda"):
        return 0
    if args.kv_cache_memory is not None:
        return parse_size(args.kv_cache_memory, "kv_cache_memory")
    from services.worker.worker import DEFAULT_CPU_KV_BYTES  # the worker's own default

    return DEFAULT_CPU_KV_BYTES


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of memory available without swapping, or None off Linux."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def _file_bytes(path) -> int:
    if path is None:
        return 0
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0
