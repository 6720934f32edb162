"""Pooling on the wire: PoolingParams <-> generation.proto's, pooled states <-> bytes
([hidden] float32 little-endian: compact, and exact)."""

from __future__ import annotations

import numpy as np

from services.common.pooling_params import PoolingParams
from services.common.proto.pagestream.v1 import generation_pb2

_FLOAT32_LE = np.dtype("<f4")


def pooling_params_to_pb(params: PoolingParams) -> generation_pb2.PoolingParams:
    return generation_pb2.PoolingParams(
        task=params.task,
        dimensions=params.dimensions,
        normalize=params.normalize,
        truncate_prompt_tokens=params.truncate_prompt_tokens,
        prompt_name=params.prompt_name,
    )


def pooling_params_from_pb(message: generation_pb2.PoolingParams) -> PoolingParams:
    """Raises ValueError (naming the field) on invalid params."""
    return PoolingParams(
        task=message.task or "embed",
        dimensions=message.dimensions if message.HasField("dimensions") else None,
        normalize=message.normalize if message.HasField("normalize") else None,
        truncate_prompt_tokens=message.truncate_prompt_tokens
        if message.HasField("truncate_prompt_tokens")
        else None,
        prompt_name=message.prompt_name if message.HasField("prompt_name") else None,
    )


def pooled_to_bytes(pooled: np.ndarray | None) -> bytes:
    return b"" if pooled is None else np.asarray(pooled, _FLOAT32_LE).tobytes()


def pooled_from_bytes(data: bytes) -> np.ndarray | None:
    if not data:
        return None
    if len(data) % 4:
        raise ValueError(f"a pooled state must be float32 values, got {len(data)} bytes")
    return np.frombuffer(data, _FLOAT32_LE).astype(np.float32)
