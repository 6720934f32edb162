"""Triton kernels with reference.py's signatures: `reshape_and_cache`, `paged_attention`,
`add_lora`.

Importing this package needs triton but no GPU. The kernels run on CUDA tensors, or on CPU
tensors through Triton's interpreter when TRITON_INTERPRET=1 was set before the kernels were
defined (i.e. before this package was first imported; in practice, before the process starts).
`unavailable_reason(device)` says why they cannot run on a device (None when they can).
"""

from __future__ import annotations

import torch

from pagestream_kernels.triton.launch import paged_attention, reshape_and_cache
from pagestream_kernels.triton.lora import add_lora
from pagestream_kernels.triton.unified_attention import unified_attention_kernel


def is_interpreted() -> bool:
    """True when the kernels were defined under TRITON_INTERPRET=1 (they run on CPU tensors)."""
    return type(unified_attention_kernel).__name__ == "InterpretedFunction"


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device`, or None when they can."""
    if is_interpreted():
        return None
    if device.type != "cuda":
        return (
            f"the Triton kernels need a CUDA device, not {device.type}; to run them on the CPU "
            "through Triton's interpreter, set TRITON_INTERPRET=1 in the environment before "
            "the process starts (before triton is imported)"
        )
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


__all__ = [
    "add_lora",
    "is_interpreted",
    "paged_attention",
    "reshape_and_cache",
    "unavailable_reason",
]
