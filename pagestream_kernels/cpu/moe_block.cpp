// See moe_block.h.
#include "moe_block.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "row_kernels.h"

namespace pagestream {
namespace {

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

MoEBlock::MoEBlock(const MoEWeights& w, int64_t hidden)
    : hidden_(hidden), top_k_(w.top_k), renormalize_(w.renormalize) {
  TORCH_CHECK(w.router.defined() && w.router.dim() == 2 && w.router.size(1) == hidden,
              "MoEWeights: router must be [experts, hidden]");
  experts_ = w.router.size(0);
  router_ = to_floats(w.router);
  TORCH_CHECK(static_cast<int64_t>(w.gate_up.size()) == experts_ &&
                  static_cast<int64_t>(w.down.size()) == experts_,
              "MoEWeights: one gate_up and one down per expert (unset off this rank)");
  TORCH_CHECK(top_k_ > 0 && top_k_ <= experts_, "MoEWeights: top_k must be in [1, experts]");
  for (int64_t e = 0; e < experts_; ++e) {
    gate_up_.push_back(w.gate_up[e].linear());
    down_.push_back(w.down[e].linear());
    TORCH_CHECK((gate_up_[e] == nullptr) == (down_[e] == nullptr),
                "MoEWeights: expert ", e, " has gate_up and down, or neither");
    if (gate_up_[e] != nullptr) check_expert(*gate_up_[e], *down_[e]);
  }
  shared_gate_up_ = w.shared_gate_up.linear();
  shared_down_ = w.shared_down.linear();
  if (shared_gate_up_ != nullptr) {
    TORCH_CHECK(shared_down_ != nullptr && w.shared_gate.defined() &&
                    w.shared_gate.numel() == hidden,
                "MoEWeights: a shared expert needs shared_down and shared_gate [hidden]");
    check_expert(*shared_gate_up_, *shared_down_);
    shared_gate_ = to_floats(w.shared_gate);
  }
}

void MoEBlock::run(const float* normed, int64_t rows, float* out) {
  route(normed, rows);
  std::fill(out, out + rows * hidden_, 0.f);
  for (int64_t e = 0; e < experts_; ++e) {
    const int64_t begin = starts_[e], n = starts_[e + 1] - begin;
    if (n == 0 || gate_up_[e] == nullptr) continue;
    gathered_.resize(n * hidden_);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = order_[begin + i] / top_k_;
      std::memcpy(gathered_.data() + i * hidden_, normed + row * hidden_, hidden_ * 4);
    }
    run_expert(*gate_up_[e], *down_[e], gathered_.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = order_[begin + i];
      add_scaled(out + (slot / top_k_) * hidden_, y_.data() + i * hidden_, weights_[slot]);
    }
  }
  if (shared_gate_up_ != nullptr) {
    run_expert(*shared_gate_up_, *shared_down_, normed, rows);
    for (int64_t r = 0; r < rows; ++r) {
      const float gate = dot(normed + r * hidden_, shared_gate_.data(), hidden_);
      add_scaled(out + r * hidden_, y_.data() + r * hidden_, 1.f / (1.f + std::exp(-gate)));
    }
  }
}

int64_t MoEBlock::weight_bytes() const {
  int64_t bytes = static_cast<int64_t>((router_.size() + shared_gate_.size()) * 4);
  for (int64_t e = 0; e < experts_; ++e) {
    if (gate_up_[e] != nullptr) bytes += gate_up_[e]->weight_bytes() + down_[e]->weight_bytes();
  }
  if (shared_gate_up_ != nullptr) {
    bytes += shared_gate_up_->weight_bytes() + shared_down_->weight_bytes();
  }
  return bytes;
}

void MoEBlock::check_expert(const Linear& gate_up, const Linear& down) const {
  TORCH_CHECK(gate_up.in_features() == hidden_ && down.out_features() == hidden_ &&
                  gate_up.out_features() == 2 * down.in_features(),
              "MoEWeights: an expert's gate_up must be [2I, hidden] and its down [hidden, I]");
}

void MoEBlock::add_scaled(float* dst, const float* src, float scale) const {
#pragma omp simd
  for (int64_t i = 0; i < hidden_; ++i) dst[i] += scale * src[i];
}

// Each row's top_k experts and weights (weights_, slot r * top_k + j), and the slots
// ordered by expert: order_[starts_[e] .. starts_[e + 1]) are expert e's.
void MoEBlock::route(const float* normed, int64_t rows) {
  picks_.resize(rows * top_k_);
  weights_.resize(rows * top_k_);
  parallel_for(rows, grain(experts_ * hidden_), [&](int64_t begin, int64_t end) {
    std::vector<float> probs(experts_);
    for (int64_t r = begin; r < end; ++r) {
      float top = -INFINITY, sum = 0.f;
      for (int64_t e = 0; e < experts_; ++e) {
        probs[e] = dot(normed + r * hidden_, router_.data() + e * hidden_, hidden_);
        top = std::max(top, probs[e]);
      }
      for (int64_t e = 0; e < experts_; ++e) sum += probs[e] = std::exp(probs[e] - top);
      float kept = 0.f;
      for (int64_t j = 0; j < top_k_; ++j) {  // the largest left, the lowest index on ties
        const int64_t best = std::max_element(probs.begin(), probs.end()) - probs.begin();
        picks_[r * top_k_ + j] = static_cast<int32_t>(best);
        weights_[r * top_k_ + j] = probs[best] / sum;
        kept += probs[best] / sum;
        probs[best] = -1.f;
      }
      if (renormalize_) {
        for (int64_t j = 0; j < top_k_; ++j) weights_[r * top_k_ + j] /= kept;
      }
    }
  });
  starts_.assign(experts_ + 1, 0);
  for (const int32_t e : picks_) ++starts_[e + 1];
  for (int64_t e = 0; e < experts_; ++e) starts_[e + 1] += starts_[e];
  order_.resize(picks_.size());
  std::vector<int64_t> next(starts_.begin(), starts_.end() - 1);
  for (int64_t slot = 0; slot < static_cast<int64_t>(picks_.size()); ++slot) {
    order_[next[picks_[slot]]++] = slot;
  }
}

// y_ [n, hidden] = down(silu(gate) * up) of x [n, hidden] float32.
void MoEBlock::run_expert(const Linear& gate_up, const Linear& down, const float* x,
                          int64_t n) {
  const int64_t inter = down.in_features();
  input_.resize(n * std::max(hidden_, inter) * 4);
  gate_up_out_.resize(n * 2 * inter);
  y_.resize(n * hidden_);
  with_type(gate_up.input_type(), "MoEBlock", [&](auto tv) {
    round_rows(reinterpret_cast<decltype(tv)*>(input_.data()), x, n, hidden_);
  });
  gate_up.run(input_.data(), n, hidden_, gate_up_out_.data(), 2 * inter, false);
  with_type(down.input_type(), "MoEBlock", [&](auto tv) {
    silu_mul_rows<float>(reinterpret_cast<decltype(tv)*>(input_.data()), gate_up_out_.data(),
                         n, inter);
  });
  down.run(input_.data(), n, inter, y_.data(), hidden_, false);
}

}  // namespace pagestream
