"""What a worker reports about itself: the model it runs and the KV cache it holds.

Torch-free, so the scheduler can read a remote worker's description. The fields match
services/worker/worker.py's ModelInfo and CacheInfo one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.model_capabilities import ModelCapabilities


@dataclass(frozen=True)
class ModelInfo:
    model: str
    architecture: str
    dtype: str
    device: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    rank: int = 0
    world_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    quantization: str = "none"  # the quantized formats in use ("Q4_1+Q8_0", "int8") or none
    weight_bytes: int = 0  # resident weight bytes of this rank
    # what the model can do: generate, pool, LoRA, the speculative decoding it runs
    capabilities: ModelCapabilities = field(default_factory=ModelCapabilities)
    # its KV cache groups (layers sharing one block table; a table holds one entry per
    # group for each block position): per group the window its layers attend within
    # (0: full attention)
    kv_cache_groups: tuple[int, ...] = (0,)

    def model_fields(self) -> dict:
        """What every rank of one group must agree on (everything but its own rank and what
        its own shard holds)."""
        values = dict(vars(self))
        for own in ("rank", "quantization", "weight_bytes"):
            values.pop(own)
        return values


@dataclass(frozen=True)
class CacheInfo:
    """How many KV blocks the worker holds: derived at run time, never written to configs."""

    num_device_blocks: int
    num_cpu_blocks: int
    block_size: int
    bytes_per_block: int
