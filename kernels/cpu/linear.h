// The GEMM interface of the native CPU step: a linear layer's weight, prepared once at load,
// multiplied into float32 outputs. Every weight format (bfloat16 and float32 today,
// quantized formats next) is a `Linear`; the decoder stack only calls `run`.
#pragma once

#include <torch/extension.h>

#include <memory>

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
};

// weight [N, K] float32 or bfloat16 (bias [N] or undefined): the packed form for this CPU.
std::shared_ptr<Linear> make_linear(const at::Tensor& weight, const at::Tensor& bias);

// Whether make_linear's kernel for `dtype` runs on this CPU (a small product checked
// against a plain one); false means the caller keeps the torch path.
bool linear_supported(at::ScalarType dtype);

}  // namespace pagestream
