"""The worker's kernels: torch references for paged attention and cache writes (the CPU path
and the test oracle), the C++ CPU kernels (cpu/: attention, the row kernels, packed and
quantized linears, the native decode step, one thread team) and Triton kernels (triton/)
with the same attention API."""

from pagestream_kernels.reference import paged_attention, paged_attention_naive, reshape_and_cache

__all__ = ["paged_attention", "paged_attention_naive", "reshape_and_cache"]
