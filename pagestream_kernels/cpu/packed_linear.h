// PackedLinear: a linear of any weight format (linear.h) as a Python object, the LM head
// with its float32 rescoring of near-ties included.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "linear.h"
#include "lm_head_rescore.h"
#include "rows.h"

namespace pagestream {

// A linear of any weight format as a Python object: the LM head, the layers handed to
// DecoderStack.add_layer, and tests. y [M, N] float32 = x W^T (+ b).
class PackedLinear {
 public:
  PackedLinear() = default;  // none yet (a LayerWeights field before it is set)
  PackedLinear(const at::Tensor& weight, const at::Tensor& bias)
      : linear_(make_linear(weight, bias)) {}
  explicit PackedLinear(std::shared_ptr<Linear> linear) : linear_(std::move(linear)) {}

  static PackedLinear quantized(int64_t bits, const at::Tensor& codes, const at::Tensor& scales,
                                const at::Tensor& mins, int64_t group, const at::Tensor& bias,
                                const std::string& format, bool bf16_rows) {
    return PackedLinear(
        make_quantized_linear(bits, codes, scales, mins, group, bias, format, bf16_rows));
  }

  // Parts of one fused layer along its output features, each in its own format.
  static PackedLinear stacked(const std::vector<PackedLinear>& parts) {
    std::vector<std::shared_ptr<Linear>> linears;
    for (const auto& part : parts) linears.push_back(part.linear());
    return PackedLinear(make_stacked_linear(linears));
  }

  // x [M, K] (any float dtype; rounded once into the weight's input type). With `exact`
  // (the plain weight [N, K]) and rescore_k > 0, each row's top rescore_k outputs are
  // recomputed as float32 dot products of x's float32 row (see rescore_rows).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& exact, int64_t rescore_k) const {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == linear_->in_features(),
                "PackedLinear: x must be [M, ", linear_->in_features(), "]");
    const auto input = x.to(linear_->input_type()).contiguous();
    const int64_t rows = x.size(0), n = linear_->out_features(), k = linear_->in_features();
    auto out = at::empty({rows, n}, at::kFloat);
    const bool rescore = rescore_k > 0 && exact.defined() && exact.numel() > 0;
    at::Tensor x32, weight;
    if (rescore) {
      TORCH_CHECK(exact.dim() == 2 && exact.size(0) == n && exact.size(1) == k,
                  "PackedLinear: the exact weight must be [", n, ", ", k, "]");
      x32 = x.to(at::kFloat).contiguous();
      weight = exact.contiguous();
    }
    pybind11::gil_scoped_release no_gil;
    linear_->run(input.data_ptr(), rows, k, out.data_ptr<float>(), n, false);
    if (rescore) {
      with_type(weight.scalar_type(), "PackedLinear", [&](auto wv) {
        using W = decltype(wv);
        rescore_rows(out.data_ptr<float>(), rows, n, x32.data_ptr<float>(), k,
                     weight.data_ptr<W>(), std::min(rescore_k, n));
      });
    }
    return out;
  }

  // Rows `ids` [n] (int64) of W as float32 [n, K] (an embedding lookup from a tied head).
  at::Tensor gather_rows(const at::Tensor& ids) const {
    const auto index = ids.to(at::kLong).contiguous();
    auto out = at::empty({index.numel(), linear_->in_features()}, at::kFloat);
    linear_->gather_rows(index.data_ptr<int64_t>(), index.numel(), out.data_ptr<float>());
    return out;
  }

  at::ScalarType input_type() const { return linear_->input_type(); }
  int64_t in_features() const { return linear_->in_features(); }
  int64_t out_features() const { return linear_->out_features(); }
  int64_t weight_bytes() const { return linear_->weight_bytes(); }
  std::string format() const { return linear_->format(); }
  const std::shared_ptr<Linear>& linear() const { return linear_; }

 private:
  std::shared_ptr<Linear> linear_;
};

}  // namespace pagestream
