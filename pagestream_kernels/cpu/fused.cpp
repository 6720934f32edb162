// Fused elementwise steps of a decoder layer on the CPU: each replaces 3-10 torch ops
// (a dispatch and a pass over memory each), which at batch 1 cost more than the math.
//
// rms_norm      out = W(W(x * rsqrt(mean(x^2) + eps)) * weight)       HF's LlamaRMSNorm
// add_rms_norm  sum = residual + x; out = rms_norm(sum)               the residual add fused
// silu_and_mul  out = O(O(silu(gate)) * up) for gate_up = [gate | up]  SwiGLU
//
// Statistics and arithmetic in float32; every rounding to bfloat16 happens where torch's
// own ops round (the casts spelled out above), so results equal the torch composition up
// to the order of the float32 sum of squares.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include "rows.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

inline void load_row(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void load_row(float* dst, const bf16* src, int64_t n) {  // exact: bf16 is a float's top
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  auto* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

using pagestream::store_row;

// Rounds a float32 row through the type T and back (a no-op for float).
inline void round_through(float* row, int64_t n, float) { (void)row, (void)n; }
inline void round_through(float* row, int64_t n, bf16) {
  std::vector<bf16> tmp(n);
  store_row(tmp.data(), row, n);
  load_row(row, tmp.data(), n);
}

// Rows per task: a small step (batch-1 decode) stays on one thread, where waking the team
// would cost more than the work.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

// One row: sum (the residual stream, float32) -> normalised, scaled by the weight, in W.
template <typename W>
void norm_row(W* out, const float* sum, const float* weight, float* scratch, int64_t h,
              float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < h; ++i) squares += sum[i] * sum[i];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) scratch[i] = sum[i] * inv;
  round_through(scratch, h, W{});  // HF: hidden.to(weight dtype), then weight * hidden
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) scratch[i] *= weight[i];
  store_row(out, scratch, h);
}

template <typename X, typename R, typename W>
void add_norm(W* out, R* sum_out, const R* residual, const X* x, const W* weight_in, int64_t rows,
              int64_t h, float eps) {
  std::vector<float> weight(h);
  load_row(weight.data(), weight_in, h);
  at::parallel_for(0, rows, grain(h), [&](int64_t begin, int64_t end) {
    std::vector<float> sum(h), other(h), scratch(h);
    for (int64_t r = begin; r < end; ++r) {
      if (residual != nullptr) {
        load_row(sum.data(), residual + r * h, h);
        load_row(other.data(), x + r * h, h);
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) sum[i] += other[i];
        round_through(sum.data(), h, R{});  // the residual add rounds in the residual's dtype
        store_row(sum_out + r * h, sum.data(), h);
      } else {
        load_row(sum.data(), x + r * h, h);
      }
      norm_row(out + r * h, sum.data(), weight.data(), scratch.data(), h, eps);
    }
  });
}

template <typename T>
void silu_mul(T* out, const T* gate_up, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    std::vector<float> gate(d), up(d);
    for (int64_t r = begin; r < end; ++r) {
      load_row(gate.data(), gate_up + r * 2 * d, d);
      load_row(up.data(), gate_up + r * 2 * d + d, d);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i]));
      round_through(gate.data(), d, T{});  // torch's silu rounds to T before the product
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) gate[i] *= up[i];
      store_row(out + r * d, gate.data(), d);
    }
  });
}

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

template <typename F>
void with_type(at::ScalarType type, F f) {
  if (type == at::kFloat) {
    f(float{});
  } else {
    f(bf16{});
  }
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
  with_type(x.scalar_type(), [&](auto xv) {
    using X = decltype(xv);
    with_type(weight.scalar_type(), [&](auto wv) {
      using W = decltype(wv);
      if (!with_residual) {
        add_norm<X, float, W>(out.data_ptr<W>(), nullptr, nullptr, x.data_ptr<X>(),
                              weight.data_ptr<W>(), rows, h, e);
        return;
      }
      with_type(residual.scalar_type(), [&](auto rv) {
        using R = decltype(rv);
        add_norm<X, R, W>(out.data_ptr<W>(), sum_out.data_ptr<R>(), residual.data_ptr<R>(),
                          x.data_ptr<X>(), weight.data_ptr<W>(), rows, h, e);
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
  with_type(gate_up.scalar_type(), [&](auto tv) {
    using T = decltype(tv);
    silu_mul<T>(out.data_ptr<T>(), gate_up.data_ptr<T>(), rows, d);
  });
}

// out [T, N * D] = x rotated: the first R features of each of the N heads of x [T, N * D]
// (rows `x_row_stride` elements apart: a slice of the fused QKV output) turned by
// cos/sin [T, R] (float32) as HF's rotate_half: out = x * cos + rotate_half(x) * sin,
// in float32, rounded once to x's dtype; features past R pass through.
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
  const int64_t tokens = x.size(0), width = x.size(1), rot = cos.size(-1), half = rot / 2;
  TORCH_CHECK(width % head_dim == 0 && rot <= head_dim && rot % 2 == 0 &&
                  cos.numel() == tokens * rot && sin.numel() == tokens * rot,
              "rotary: shape mismatch");
  const int64_t heads = width / head_dim, stride = x.stride(0);
  with_type(x.scalar_type(), [&](auto tv) {
    using T = decltype(tv);
    const T* src = x.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();
    at::parallel_for(0, tokens, grain(width), [&](int64_t begin, int64_t end) {
      std::vector<float> in(width), res(width);
      for (int64_t t = begin; t < end; ++t) {
        load_row(in.data(), src + t * stride, width);
        const float* ct = c + t * rot;
        const float* st = s + t * rot;
        for (int64_t h = 0; h < heads; ++h) {
          const float* a = in.data() + h * head_dim;
          float* r = res.data() + h * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) r[i] = a[i] * ct[i] - a[i + half] * st[i];
#pragma omp simd
          for (int64_t i = half; i < rot; ++i) r[i] = a[i] * ct[i] + a[i - half] * st[i];
          for (int64_t i = rot; i < head_dim; ++i) r[i] = a[i];
        }
        store_row(dst + t * width, res.data(), width);
      }
    });
  });
}
