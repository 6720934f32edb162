"""Attention kernels: torch references (the CPU path) and Triton kernels with the same API."""

from pagestream_kernels.reference import paged_attention, paged_attention_naive, reshape_and_cache

__all__ = ["paged_attention", "paged_attention_naive", "reshape_and_cache"]
