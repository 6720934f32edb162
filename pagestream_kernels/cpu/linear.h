// The GEMM interface of the native CPU step: a linear layer's weight, prepared once at load,
// multiplied into float32 outputs. Every weight format (bfloat16 and float32 in linear.cpp,
// the weight-only quantized formats in quantized_linear.cpp) is a `Linear`; the decoder
// stack only calls `run`.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <string>
#include <vector>

namespace pagestream {

class Linear {
 public:
  virtual ~Linear() = default;
  // The dtype the input rows must be in (the stack rounds its activations into it once).
  virtual at::ScalarType input_type() const = 0;
  virtual int64_t in_features() const = 0;
  virtual int64_t out_features() const = 0;
  // out[m, :N] (+)= x[m, :K] W^T (+ bias) for m < M: x rows ld_x elements apart (in
  // input_type()), out rows ld_out floats apart; `accumulate` adds to out. float32
  // accumulation; the output columns are split across the intra-op threads, so each
  // weight byte is read once per call.
  virtual void run(const void* x, int64_t M, int64_t ld_x, float* out, int64_t ld_out,
                   bool accumulate) const = 0;
  // Rows ids[0..n) of W (output features) as float32, K floats each, into out.
  virtual void gather_rows(const int64_t* ids, int64_t n, float* out) const = 0;
  // Bytes of the packed weight this object holds (scales and padding included).
  virtual int64_t weight_bytes() const = 0;
  // What the weight is stored as: "bfloat16", "float32", or the quantized source format.
  virtual std::string format() const = 0;
};

// weight [N, K] float32 or bfloat16 (bias [N] or undefined): the packed form for this CPU.
std::shared_ptr<Linear> make_linear(const at::Tensor& weight, const at::Tensor& bias);

// A weight-only quantized weight [N, K]: w[n, k] = scales[n, k / group] * code[n, k]
// (+ mins[n, k / group]), in float32. codes: bits 8: int8 [N, K]; bits 4: uint8 [N, K / 2]
// with code(2j) in the low nibble of byte j and code(2j + 1) in the high one. scales (and
// mins, or an undefined / empty tensor) [N, K / group], float16 or float32. `format` names
// the source format for logs (Q4_1, int8, ...). bf16_rows: products of many rows may run
// in bfloat16 (a bfloat16 model's precision), else float32.
std::shared_ptr<Linear> make_quantized_linear(int64_t bits, const at::Tensor& codes,
                                              const at::Tensor& scales, const at::Tensor& mins,
                                              int64_t group, const at::Tensor& bias,
                                              const std::string& format, bool bf16_rows);

// Linears of one input stacked along the output features (a fused layer whose parts came
// in different formats, e.g. Q4_K query / key rows beside Q6_K value rows): each part runs
// into its own columns of the output, so no part is widened to another's format.
std::shared_ptr<Linear> make_stacked_linear(const std::vector<std::shared_ptr<Linear>>& parts);

// Up to how many rows a bfloat16 model's quantized linears stream their codes through the
// VNNI kernel (default 32; more rows: de-quantized blocks and brgemm); returns the
// previous value, and a negative `rows` restores the default. For benchmarks and tests
// that compare the two paths.
int64_t set_quantized_stream_rows(int64_t rows);

// Whether make_linear's kernel for `dtype` runs on this CPU (a small product checked
// against a plain one); false means the caller keeps the torch path.
bool linear_supported(at::ScalarType dtype);

}  // namespace pagestream
