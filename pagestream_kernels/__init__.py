"""The worker's kernels: torch references for paged attention and cache writes (the CPU path
and the test oracle), the C++ CPU extension (cpu/: attention, fused row ops, packed and
quantized linears, the native decode step) and Triton kernels (triton/) with the same API."""

from pagestream_kernels.reference import paged_attention, paged_attention_naive, reshape_and_cache

__all__ = ["paged_attention", "paged_attention_naive", "reshape_and_cache"]
