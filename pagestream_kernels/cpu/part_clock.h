// Seconds spent in each part of the native step, summed over calls while profiling is on
// (DecoderStack.set_profiling / profile, read by benchmarks/native_step_profile.py); off,
// it costs one branch per part.
#pragma once

#include <chrono>

namespace pagestream {

enum Part { NORM_QKV, ROTARY_CACHE, ATTENTION, O_PROJ, NORM_GATE_UP, SILU, DOWN, NUM_PARTS };
constexpr const char* PART_NAMES[NUM_PARTS] = {"norm+qkv",     "rotary+cache", "attention", "o_proj",
                                               "norm+gate_up", "silu_mul",     "down"};

class PartClock {
 public:
  bool on = false;
  double seconds[NUM_PARTS] = {};
  void start() {
    if (on) last_ = std::chrono::steady_clock::now();
  }
  void stop(Part part) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    seconds[part] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  std::chrono::steady_clock::time_point last_;
};

}  // namespace pagestream
