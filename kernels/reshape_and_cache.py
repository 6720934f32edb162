"""Write one step's new keys and values into the paged KV cache (torch reference).

The Triton kernel in this package shares this exact signature.
"""

from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into their cache slots, in place.

    key, value:   [num_tokens, num_kv_heads, head_dim]
    kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V), contiguous
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; negative = skip
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    # .view (not .reshape) so a non-contiguous cache fails loudly instead of writing to a copy.
    key_slots = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, num_kv_heads, head_dim]
    value_slots = kv_cache[1].view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0  # [num_tokens]
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    key_slots.index_copy_(0, slots, key.to(kv_cache.dtype))
    value_slots.index_copy_(0, slots, value.to(kv_cache.dtype))
