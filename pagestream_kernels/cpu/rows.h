// Row copies between float32 and the kernels' storage types, shared by the C++ sources.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace pagestream {

inline void store_row(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// float32 -> bfloat16, round to nearest even as c10::BFloat16 and torch's .to do (a NaN
// stays a quiet NaN).
inline void store_row(c10::BFloat16* dst, const float* src, int64_t n) {
  const auto* s = reinterpret_cast<const uint32_t*>(src);
  auto* d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = s[i];
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    d[i] = (bits & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
  }
}

}  // namespace pagestream
