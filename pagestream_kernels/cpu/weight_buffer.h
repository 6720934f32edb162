// Packed weights on 2 MiB-aligned memory marked for transparent huge pages, shared by the
// linears of the native CPU step (linear.cpp, quantized_linear.cpp).
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pagestream {

// Weight storage, 64-byte aligned. A decode step streams every weight once, and with 4 KiB
// pages a TLB miss every 4 KiB slows the stream, so a large buffer (HUGE_FROM and up) is
// rounded up to whole 2 MiB pages and marked for transparent huge pages; a smaller one
// keeps its exact size (a 2 MiB page per small weight would multiply the resident memory
// of a quantized model).
template <typename T>
class WeightBuffer {
 public:
  static constexpr size_t HUGE = size_t{2} << 20;
  static constexpr size_t HUGE_FROM = size_t{16} << 20;  // rounding wastes < 12.5 %

  explicit WeightBuffer(int64_t n) {
    const size_t want = std::max<size_t>(static_cast<size_t>(n) * sizeof(T), 64);
    const bool huge = want >= HUGE_FROM;
    const size_t align = huge ? HUGE : 64;
    bytes_ = (want + align - 1) / align * align;
    data_ = static_cast<T*>(std::aligned_alloc(align, bytes_));
    TORCH_CHECK(data_ != nullptr, "cannot allocate ", bytes_, " bytes for a packed weight");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (huge) madvise(data_, bytes_, MADV_HUGEPAGE);  // advice only: failure is fine
#endif
  }
  ~WeightBuffer() { std::free(data_); }
  WeightBuffer(const WeightBuffer&) = delete;
  WeightBuffer& operator=(const WeightBuffer&) = delete;
  int64_t bytes() const { return static_cast<int64_t>(bytes_); }
  T* data() { return data_; }
  const T* data() const { return data_; }

 private:
  size_t bytes_ = 0;
  T* data_ = nullptr;
};

}  // namespace pagestream
