"""Attention kernels: torch references (the CPU path) and, later, Triton kernels sharing them."""

from kernels.paged_attention import paged_attention, paged_attention_naive
from kernels.reshape_and_cache import reshape_and_cache

__all__ = ["paged_attention", "paged_attention_naive", "reshape_and_cache"]
