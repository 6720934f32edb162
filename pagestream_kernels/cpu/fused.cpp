// The torch modules' fused row ops (services/worker/layers: layernorm, activation, rotary):
// argument checks, then the row kernels (row_kernels.h) in the tensors' types. Each rounds
// to bfloat16 where torch's own composition rounds, so the results equal it up to the order
// of the float32 sum of squares.
#include <torch/extension.h>

#include <utility>
#include <vector>

#include "row_kernels.h"

namespace {

using pagestream::with_type;

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

}  // namespace

// out = rms_norm(residual + x) and sum_out = residual + x, or out = rms_norm(x) without
// a residual. x, residual: [rows, h]; weight [h]; out in the weight's dtype.
void add_rms_norm(torch::Tensor out, torch::Tensor sum_out, torch::Tensor residual,
                  torch::Tensor x, torch::Tensor weight, double eps) {
  const bool with_residual = residual.defined() && residual.numel() > 0;
  for (const auto& [t, name] : {std::pair{x, "x"}, std::pair{weight, "weight"},
                                std::pair{out, "out"}}) {
    check(t, name);
  }
  TORCH_CHECK(out.scalar_type() == weight.scalar_type(), "out must have the weight's dtype");
  const int64_t h = x.size(-1), rows = x.numel() / std::max<int64_t>(1, h);
  TORCH_CHECK(weight.numel() == h && out.numel() == x.numel(), "add_rms_norm: shape mismatch");
  if (with_residual) {
    check(residual, "residual");
    check(sum_out, "sum_out");
    TORCH_CHECK(residual.numel() == x.numel() && sum_out.numel() == x.numel() &&
                    sum_out.scalar_type() == residual.scalar_type(),
                "add_rms_norm: residual / sum_out mismatch");
  }
  const auto e = static_cast<float>(eps);
  const std::vector<float> w = pagestream::to_floats(weight);
  with_type(x.scalar_type(), "add_rms_norm", [&](auto xv) {
    using X = decltype(xv);
    with_type(weight.scalar_type(), "add_rms_norm", [&](auto wv) {
      using W = decltype(wv);
      if (!with_residual) {
        pagestream::add_norm_rows<X, float, W>(out.data_ptr<W>(), nullptr, nullptr,
                                               x.data_ptr<X>(), w.data(), rows, h, e);
        return;
      }
      with_type(residual.scalar_type(), "add_rms_norm", [&](auto rv) {
        using R = decltype(rv);
        pagestream::add_norm_rows<X, R, W>(out.data_ptr<W>(), sum_out.data_ptr<R>(),
                                           residual.data_ptr<R>(), x.data_ptr<X>(), w.data(),
                                           rows, h, e);
      });
    });
  });
}

// out [rows, d] = silu(gate) * up for gate_up [rows, 2d] = [gate | up].
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up) {
  check(gate_up, "gate_up");
  check(out, "out");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "silu_and_mul: dtype mismatch");
  const int64_t d = gate_up.size(-1) / 2, rows = gate_up.numel() / std::max<int64_t>(1, 2 * d);
  TORCH_CHECK(out.numel() == rows * d, "silu_and_mul: out must be [rows, d]");
  with_type(gate_up.scalar_type(), "silu_and_mul", [&](auto tv) {
    using T = decltype(tv);
    pagestream::silu_mul_rows<T>(out.data_ptr<T>(), gate_up.data_ptr<T>(), rows, d);
  });
}

// out [T, N * D] = x rotated: the first R features of each of the N heads of x [T, N * D]
// (rows `x.stride(0)` elements apart: a slice of the fused QKV output) turned by cos/sin
// [T, R] (float32) as HF's rotate_half, in float32, rounded once to x's dtype.
void rotary(torch::Tensor out, torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
            int64_t head_dim) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "rotary: x must be a CPU [tokens, heads * head_dim] with unit feature stride");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == x.scalar_type() &&
                  out.sizes() == x.sizes(),
              "rotary: out must be a contiguous tensor like x");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary: cos and sin must be contiguous float32");
  const int64_t tokens = x.size(0), width = x.size(1), rot = cos.size(-1);
  TORCH_CHECK(width % head_dim == 0 && rot <= head_dim && rot % 2 == 0 &&
                  cos.numel() == tokens * rot && sin.numel() == tokens * rot,
              "rotary: shape mismatch");
  with_type(x.scalar_type(), "rotary", [&](auto tv) {
    using T = decltype(tv);
    pagestream::rotary_rows(out.data_ptr<T>(), width, x.data_ptr<T>(), x.stride(0), tokens,
                            width / head_dim, head_dim, cos.data_ptr<float>(),
                            sin.data_ptr<float>(), rot);
  });
}
