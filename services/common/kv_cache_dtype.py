"""The names `--kv-cache-dtype` accepts and what each means, in one place (torch-free: the
config and the flags read it; the worker resolves the torch dtype from it).

- auto: the model's dtype; float32 / bfloat16 / float16: that dtype.
- q8_0 (llama.cpp's `-ctk q8_0 -ctv q8_0`): int8 codes with a float16 scale per 32 values,
  34 bytes per 32 (pagestream_kernels/q8_0.py); int8 is an alias of it. The CPU attention
  backends (cpu, torch) only, and a head_dim that is a multiple of 32.
- fp8 / fp8_e4m3 (torch.float8_e4m3fn) and fp8_e5m2 (torch.float8_e5m2), vLLM's names:
  the Triton (CUDA) backend only.
"""

from __future__ import annotations

FLOAT_KV_DTYPES = ("float32", "bfloat16", "float16")
Q8_0_NAMES = ("q8_0", "int8")  # int8: an alias of q8_0 (one layout, one kernel)
# vLLM's fp8 names -> the torch dtype's name (getattr(torch, name))
FP8_TORCH_NAMES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
KV_CACHE_DTYPES = ("auto", *FLOAT_KV_DTYPES, *Q8_0_NAMES, *FP8_TORCH_NAMES)
# The attention backends that read each kind of cache
Q8_0_BACKENDS = ("cpu", "torch")
FP8_BACKENDS = ("triton",)


def canonical(name: str) -> str:
    """The one name of the layout `name` stands for (int8 -> q8_0, fp8 -> fp8_e4m3): what
    an identity of cached KV bytes (the offload tiers' files) should key on."""
    if is_q8_0(name):
        return "q8_0"
    if name == "fp8":
        return "fp8_e4m3"
    return name


def is_q8_0(name: str) -> bool:
    return name in Q8_0_NAMES


def is_fp8(name: str) -> bool:
    return name in FP8_TORCH_NAMES


def check_backend(name: str, attention_backend: str) -> None:
    """ValueError unless the resolved attention backend reads a `name` cache."""
    allowed = Q8_0_BACKENDS if is_q8_0(name) else FP8_BACKENDS if is_fp8(name) else None
    if allowed is not None and attention_backend not in allowed:
        choices = ", ".join(_choices_for(attention_backend))
        raise ValueError(
            f"--kv-cache-dtype {name} runs on the {' or '.join(allowed)} attention backend, "
            f"not {attention_backend}; --kv-cache-dtype takes {choices} with it"
        )


def _choices_for(attention_backend: str) -> list[str]:
    names = ["auto", *FLOAT_KV_DTYPES]
    if attention_backend in Q8_0_BACKENDS:
        names += Q8_0_NAMES
    if attention_backend in FP8_BACKENDS:
        names += FP8_TORCH_NAMES
    return names
