"""Weight-only quantized linear weights, on the torch side.

One module per concern:

- `quantized_weight`: `QuantizedWeight`, the one representation of a quantized linear
  weight [N, K] (int8 or packed 4-bit codes, per-group scales and optional mins), its
  torch reference `dequantize()`, and the exact narrowing / concatenation that sharding and
  fused layers need (`narrow_rows`, `narrow_cols`, `cat_rows`).
- `gguf_blocks`: GGUF's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K,
  IQ4_XS) decoded, exactly, into `QuantizedWeight`; `gguf_float` for GGUF's float tensors.
- `online`: quantizers of float weights at load (`quantize_int8` per output channel,
  `quantize_int4` per group).

The C++ kernels (pagestream_kernels/cpu/quantized_linear.cpp) repack a `QuantizedWeight` once, at
load, into their own layout; `dequantize()` is what their results are checked against.
"""

from services.worker.layers.quantization.gguf_blocks import (
    GGUF_BLOCK_TYPES,
    UnsupportedQuantization,
    decode_gguf,
    gguf_float,
)
from services.worker.layers.quantization.online import quantize_int4, quantize_int8
from services.worker.layers.quantization.quantized_weight import QuantizedWeight, cat_rows

__all__ = [
    "GGUF_BLOCK_TYPES",
    "QuantizedWeight",
    "UnsupportedQuantization",
    "cat_rows",
    "decode_gguf",
    "gguf_float",
    "quantize_int4",
    "quantize_int8",
]
