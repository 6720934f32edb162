"""The float linear of the torch path on the CPU: y = x W^T (+ b), through the fastest of
oneDNN's packed weight, oneDNN on the plain weight, or W @ x^T for a few rows (measured;
see `linear`). Any other device or dtype runs F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.layers.packed_weight import PackedWeight

# float32 CPU matmuls with at most this many rows (tokens) run as W @ x^T (see `linear`).
SMALL_BATCH_MAX_ROWS = 4


def _onednn_linear_op():
    """oneDNN's linear (what torch.compile emits for CPU linears), where this torch has it."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    return op if op is not None and torch.backends.mkldnn.is_available() else None


_ONEDNN_LINEAR = _onednn_linear_op()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [num_tokens, in] and weight [out, in], faster on CPU.

    `packed` (the weight in oneDNN's layout, made once at load) is used from its
    `rows_from` rows on; below that, and without it, the plain paths:

    For float32 on CPU, F.linear's MKL GEMM is far below what the machine does at these shapes.
    Measured over SmolLM2-135M's 30 layers (weights streamed from memory, as in a forward
    pass), torch 2.13, 2-core EPYC, ms per pass at 1 / 2 / 8 / 64 / 2048 rows:
    F.linear 34 / 58 / 41 / 105 / 2307, oneDNN's linear 21 / 23 / 30 / 87 / 2014,
    W @ x^T 15 / 15 / 34 / 100 / 2761 (a single row padded to two: W @ x^T with one column
    is a matrix-vector product, as slow as F.linear). The LM head (49152 x 576) at 1 / 2 / 64
    rows: 9.5 / 21.5 / 33 ms with F.linear, 3.2 / 3.3 / 40.6 as W @ x^T, 4.2 / 5.2 / 21
    with oneDNN. So up to SMALL_BATCH_MAX_ROWS rows (decode steps of a small batch) run as
    W @ x^T, more rows through oneDNN. Results equal F.linear's to float32 rounding.
    """
    if packed is not None and packed.applies(x):
        return packed(x, bias)
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or rows == 0:
        return F.linear(x, weight, bias)
    if rows > SMALL_BATCH_MAX_ROWS:
        if _ONEDNN_LINEAR is None:
            return F.linear(x, weight, bias)
        return _ONEDNN_LINEAR(x.contiguous(), weight, bias, "none", [], "")
    columns = torch.cat([x, x]) if rows == 1 else x  # [max(rows, 2), in]
    out = torch.mm(weight, columns.t())[:, :rows].t().contiguous()  # [rows, out]
    if bias is not None:
        out += bias
    return out
