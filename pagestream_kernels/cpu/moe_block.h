// A layer's mixture of gated experts in the native step (services/worker/layers/fused_moe.py
// is the torch reference).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "linear.h"
#include "packed_linear.h"

namespace pagestream {

// router [E, hidden] float32; per expert its gate_up [2I, hidden] and down [hidden, I]
// (unset for an expert another rank holds); each token's top_k experts by the router's
// softmax, renormalised to sum to 1 where `renormalize`; an optional shared expert every
// token passes through, scaled by sigmoid(shared_gate . x) (shared_gate [hidden]).
struct MoEWeights {
  at::Tensor router;
  std::vector<PackedLinear> gate_up, down;
  int64_t top_k = 0;
  bool renormalize = true;
  PackedLinear shared_gate_up, shared_down;
  at::Tensor shared_gate;
};

// The mixture's step: the rows grouped by expert, each expert's gate/up, SiLU and down
// run once over its rows (each weight byte read once per step), the weighted outputs
// summed per row in float32.
class MoEBlock {
 public:
  MoEBlock(const MoEWeights& w, int64_t hidden);

  // out [rows, hidden] = the mixture of normed [rows, hidden] (float32): this rank's part
  // of it under tensor or expert parallelism (the caller sums the ranks').
  void run(const float* normed, int64_t rows, float* out);

  int64_t weight_bytes() const;

 private:
  void check_expert(const Linear& gate_up, const Linear& down) const;
  void add_scaled(float* dst, const float* src, float scale) const;
  void route(const float* normed, int64_t rows);
  void run_expert(const Linear& gate_up, const Linear& down, const float* x, int64_t n);

  int64_t hidden_, top_k_, experts_ = 0;
  bool renormalize_;
  std::vector<float> router_, shared_gate_;
  std::vector<std::shared_ptr<Linear>> gate_up_, down_;
  std::shared_ptr<Linear> shared_gate_up_, shared_down_;
  // one step's routing and buffers
  std::vector<int32_t> picks_;
  std::vector<float> weights_, gathered_, gate_up_out_, y_;
  std::vector<int64_t> starts_, order_;
  std::vector<uint8_t> input_;
};

}  // namespace pagestream
