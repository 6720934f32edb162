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
// pages a TLB miss every 4 KiB slows the stream, so a buffer of 2 MiB and up starts on a
// 2 MiB boundary and is marked for transparent huge pages: its whole 2 MiB extents become
// huge pages (under THP "madvise", the usual default, only marked memory does), its tail
// stays in 4 KiB pages, so nothing is rounded up and the resident size stays exact. Which
// weights got huge pages must not depend on what the heap held before (the load's order):
// every large one is marked.
template <typename T>
class WeightBuffer {
 public:
  static constexpr size_t HUGE = size_t{2} << 20;
  explicit WeightBuffer(int64_t n) {
    const size_t want = std::max<size_t>(static_cast<size_t>(n) * sizeof(T), 64);
    const bool huge = want >= HUGE;
    bytes_ = (want + 63) / 64 * 64;
    void* data = nullptr;
    const int failed = posix_memalign(&data, huge ? HUGE : 64, bytes_);
    TORCH_CHECK(failed == 0 && data != nullptr, "cannot allocate ", bytes_,
                " bytes for a packed weight");
    data_ = static_cast<T*>(data);
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
