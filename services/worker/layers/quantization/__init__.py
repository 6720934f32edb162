"""Weight-only quantized linear weights, on the torch side: `QuantizedWeight` (the one
representation, its exact narrowing and its `dequantize()` reference), GGUF's block formats
decoded into it (gguf_blocks), a file's tensor kept undecoded until its layer is packed
(mapped_blocks), and the online int8 / int4 quantizers (online). The C++ kernels
(pagestream_kernels/cpu/quantized_linear.cpp) repack a QuantizedWeight once, at load, into
their own layout; `dequantize()` is what their results are checked against.
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
