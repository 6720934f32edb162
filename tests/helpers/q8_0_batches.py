"""Paged-attention batches over a q8_0 KV cache: a float batch (paged_attention_batches) with
its cache quantized (NaN blocks keep NaN scales, so a stray read still poisons) and its
ground-truth keys and values replaced by the values the cache holds."""

from __future__ import annotations

import dataclasses

from pagestream_kernels import q8_0
from tests.helpers.paged_attention_batches import Batch


def round_trip(x):
    """x as a q8_0 cache holds it (float32)."""
    return q8_0.dequantize(q8_0.quantize(x))


def quantized_batch(batch: Batch) -> Batch:
    """`batch` over a q8_0 cache; its keys/values: the dequantized ones."""
    return dataclasses.replace(
        batch,
        kv_cache=q8_0.quantize(batch.kv_cache.float()),
        keys=[round_trip(k) for k in batch.keys],
        values=[round_trip(v) for v in batch.values],
    )
