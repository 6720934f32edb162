// The LM head's near-ties decided in float32: the packed GEMM rounds its input into the
// weight's input type, so each row's top candidates are recomputed exactly.
#pragma once

#include <cstdint>
#include <vector>

#include "thread_pool.h"

namespace pagestream {

// Top `k` logits of each row recomputed exactly: float32 hidden row . float32 of the weight
// row (the LM head's weight in its own dtype), so near-ties among the candidates are
// decided as a float32 LM head on the same weights would (the GEMM's input was rounded).
template <typename W>
void rescore_rows(float* logits, int64_t rows, int64_t vocab, const float* hidden, int64_t h,
                  const W* weight, int64_t k) {
  parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> top(k);
    std::vector<float> w(h);
    for (int64_t r = begin; r < end; ++r) {
      float* row = logits + r * vocab;
      int64_t filled = 0;  // top[0..filled) sorted by descending logit
      for (int64_t v = 0; v < vocab; ++v) {
        if (filled == k && row[v] <= row[top[k - 1]]) continue;
        int64_t i = filled < k ? filled++ : k - 1;
        for (; i > 0 && row[top[i - 1]] < row[v]; --i) top[i] = top[i - 1];
        top[i] = v;
      }
      const float* x = hidden + r * h;
      for (int64_t i = 0; i < filled; ++i) {
        const W* src = weight + top[i] * h;
        for (int64_t j = 0; j < h; ++j) w[j] = static_cast<float>(src[j]);
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < h; ++j) dot += x[j] * w[j];
        row[top[i]] = dot;
      }
    }
  });
}

}  // namespace pagestream
