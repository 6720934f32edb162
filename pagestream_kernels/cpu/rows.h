// Row conversions between float32 and the kernels' storage types (float32, bfloat16), and
// the dispatch on those types, shared by the C++ sources.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace pagestream {

using bf16 = c10::BFloat16;

inline void store_row(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// float32 -> bfloat16, round to nearest even as c10::BFloat16 and torch's .to do (a NaN
// stays a quiet NaN).
inline uint16_t bf16_bits(uint32_t bits) {
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

inline void store_row(bf16* dst, const float* src, int64_t n) {
  const auto* s = reinterpret_cast<const uint32_t*>(src);
  auto* d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_bits(s[i]);
}

inline void load_row(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void load_row(float* dst, const bf16* src, int64_t n) {  // exact: bf16 is a float's top
  const auto* s = reinterpret_cast<const uint16_t*>(src);
  auto* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

// The row as float32: src itself for float, else loaded into `buffer`.
template <typename T>
inline const float* float_row(const T* src, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    (void)buffer, (void)n;
    return src;
  } else {
    load_row(buffer, src, n);
    return buffer;
  }
}

// Rounds a float32 row through T and back in place (a no-op for float): where torch's
// composition stores an intermediate in T.
template <typename T>
inline void round_through(float* row, int64_t n) {
  if constexpr (std::is_same_v<T, bf16>) {
    auto* bits = reinterpret_cast<uint32_t*>(row);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) bits[i] = static_cast<uint32_t>(bf16_bits(bits[i])) << 16;
  } else {
    static_assert(std::is_same_v<T, float>);
    (void)row, (void)n;
  }
}

// dst (C) = src (S) rounded as torch's .to.
template <typename S, typename C>
inline void convert_row(C* dst, const S* src, int64_t n) {
  if constexpr (std::is_same_v<S, C>) {
    std::memcpy(dst, src, n * sizeof(C));
  } else if constexpr (std::is_same_v<S, float>) {
    store_row(dst, src, n);
  } else {
    load_row(dst, src, n);
  }
}

// f(T{}) for the storage type T of `type`: float32 or bfloat16, else an error naming `what`.
template <typename F>
void with_type(at::ScalarType type, const char* what, F f) {
  if (type == at::kBFloat16) {
    f(bf16{});
  } else {
    TORCH_CHECK(type == at::kFloat, what, ": float32 or bfloat16, not ", type);
    f(float{});
  }
}

inline std::vector<float> to_floats(const at::Tensor& t) {
  const auto f = t.to(at::kFloat).contiguous();
  return {f.data_ptr<float>(), f.data_ptr<float>() + f.numel()};
}

}  // namespace pagestream
