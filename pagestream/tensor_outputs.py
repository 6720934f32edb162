"""Pooled states as torch tensors at the public API (vLLM's PoolingOutput.data is one); the
engine's layers below keep numpy, so the frontend and the scheduler never import torch."""

from __future__ import annotations

import torch

from services.common.outputs import PoolingOutput, PoolingRequestOutput


def as_tensors(output: PoolingRequestOutput) -> PoolingRequestOutput:
    """The output with its pooled state [hidden] as a float32 torch tensor."""
    if output.outputs is not None:
        output.outputs = PoolingOutput(torch.from_numpy(output.outputs.data))
    return output
