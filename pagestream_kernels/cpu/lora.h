// LoRA adapters in the native step: the adds B (A x) after one linear of the decoder stack,
// for the rows of each adapter slot.
// The slot tensors are Python's (services/worker/lora/lora_slots.py: A [S, R, K] and
// B [S, n, R] float32 per slice of a fused linear, scale folded into B). `load_slot` copies
// one slot into the layout the loops want, in the linear's input type: A as it is
// ([S][R][K], a shrink is r dot products over K) and B transposed ([S][R][n], an expand is
// r row updates over n), so every inner loop runs over contiguous memory and a bfloat16
// model reads half the bytes. Rows without an adapter are never touched.
#pragma once

#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "thread_pool.h"

namespace pagestream {

// One slice of a fused linear (q, k or v of qkv; gate or up of gate_up; all of o / down).
struct LoRASlice {
  at::Tensor a, b;  // Python's slot tensors: [S, R, K], [S, n, R] float32
  int64_t offset = 0;  // the slice's first output column
  int64_t slots = 0, rank = 0, k = 0, n = 0;
  at::Tensor a_copy, b_t;  // [S, R, K] and [S, R, n] in the linear's input type

  LoRASlice(const at::Tensor& a_, const at::Tensor& b_, int64_t offset_, int64_t in_features,
            int64_t out_features, at::ScalarType type)
      : a(a_), b(b_), offset(offset_) {
    TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.scalar_type() == at::kFloat &&
                    b.scalar_type() == at::kFloat && a.is_contiguous() && b.is_contiguous(),
                "DecoderStack.set_lora: A and B must be contiguous float32 [S, R, K] and [S, n, R]");
    slots = a.size(0), rank = a.size(1), k = a.size(2), n = b.size(1);
    TORCH_CHECK(b.size(0) == slots && b.size(2) == rank,
                "DecoderStack.set_lora: A is [", slots, ", ", rank, ", ", k, "], B must be [", slots,
                ", n, ", rank, "], got [", b.size(0), ", ", b.size(1), ", ", b.size(2), "]");
    TORCH_CHECK(k == in_features, "DecoderStack.set_lora: A has ", k,
                " input features, the linear ", in_features);
    TORCH_CHECK(offset >= 0 && offset + n <= out_features, "DecoderStack.set_lora: the slice [",
                offset, ", ", offset + n, ") is outside the linear's ", out_features, " outputs");
    a_copy = at::zeros({slots, rank, k}, at::TensorOptions().dtype(type));
    b_t = at::zeros({slots, rank, n}, at::TensorOptions().dtype(type));
  }

  void load_slot(int64_t slot) {
    a_copy[slot].copy_(a[slot]);
    b_t[slot].copy_(b[slot].t());
  }
};

using LinearLoRA = std::vector<LoRASlice>;

// One step's rows with an adapter, ordered by slot, and the slots' ranks.
class LoRARows {
 public:
  // slots [T] int32 (-1: none) and ranks [S] int32, or empty tensors: no adapter this step.
  void plan(const at::Tensor& slots, const at::Tensor& ranks, int64_t rows) {
    rows_.clear();
    if (!slots.defined() || slots.numel() == 0) return;
    TORCH_CHECK(slots.scalar_type() == at::kInt && slots.is_contiguous() && slots.numel() == rows,
                "DecoderStack.forward: lora_slots must be int32 [T]");
    TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous(),
                "DecoderStack.forward: lora_ranks must be int32 [S]");
    const int32_t* s = slots.data_ptr<int32_t>();
    const int32_t* r = ranks.data_ptr<int32_t>();
    ranks_.assign(r, r + ranks.numel());
    for (int64_t t = 0; t < rows; ++t) {
      TORCH_CHECK(s[t] < static_cast<int32_t>(ranks_.size()), "DecoderStack.forward: row ", t,
                  " has LoRA slot ", s[t], " of ", ranks_.size());
      if (s[t] >= 0 && ranks_[s[t]] > 0) rows_.push_back(static_cast<int32_t>(t));
    }
    std::stable_sort(rows_.begin(), rows_.end(), [&](int32_t x, int32_t y) { return s[x] < s[y]; });
    slot_.resize(rows_.size());
    for (size_t i = 0; i < rows_.size(); ++i) slot_[i] = s[rows_[i]];
  }

  bool empty() const { return rows_.empty(); }
  int64_t size() const { return static_cast<int64_t>(rows_.size()); }
  int32_t row(int64_t i) const { return rows_[i]; }
  int32_t slot(int64_t i) const { return slot_[i]; }
  int32_t rank(int32_t slot) const { return ranks_[slot]; }

 private:
  std::vector<int32_t> rows_, slot_, ranks_;
};

namespace lora_detail {

template <typename T>
inline float as_float(T v) {
  return static_cast<float>(v);
}

// out[offset + j] += sum_{kk < r} b_t[kk, j] * (a[kk, :] . x), one row, one slice.
template <typename W>
void add_row(const LoRASlice& slice, int32_t slot, int32_t r, const float* x, float* out,
             float* shrunk) {
  const int64_t k = slice.k, n = slice.n, rank = std::min<int64_t>(r, slice.rank);
  const W* a = slice.a_copy.data_ptr<W>() + slot * slice.rank * k;
  const W* bt = slice.b_t.data_ptr<W>() + slot * slice.rank * n;
  for (int64_t kk = 0; kk < rank; ++kk) {
    const W* arow = a + kk * k;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t c = 0; c < k; ++c) acc += x[c] * as_float(arow[c]);
    shrunk[kk] = acc;
  }
  float* y = out + slice.offset;
  for (int64_t kk = 0; kk < rank; ++kk) {
    const W* brow = bt + kk * n;
    const float t = shrunk[kk];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] += t * as_float(brow[j]);
  }
}

}  // namespace lora_detail

// out[row, slice] += B (A x[row]) for every planned row; x [T, K] in the linear's input type
// X (float or bf16), out rows `ld` floats apart. Rows of one slot are adjacent, so a thread's
// rows mostly share their slot's A and B in cache.
template <typename X>
void add_lora(const LinearLoRA& lora, const LoRARows& rows, const X* x, int64_t k, float* out,
              int64_t ld) {
  if (lora.empty() || rows.empty()) return;
  int64_t work = 0;  // multiply-adds per row at the widest rank
  int64_t widest = 0;
  for (const auto& slice : lora) {
    work += slice.rank * (slice.k + slice.n);
    widest = std::max(widest, slice.rank);
  }
  const bool bf16 = lora.front().a_copy.scalar_type() == at::kBFloat16;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, work));
  pagestream::parallel_for(rows.size(), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row_in(k), shrunk(widest);
    for (int64_t i = begin; i < end; ++i) {
      const int32_t t = rows.row(i), slot = rows.slot(i), r = rows.rank(slot);
      const X* src = x + static_cast<int64_t>(t) * k;
      for (int64_t c = 0; c < k; ++c) row_in[c] = static_cast<float>(src[c]);
      float* y = out + static_cast<int64_t>(t) * ld;
      for (const auto& slice : lora) {
        if (bf16) {
          lora_detail::add_row<c10::BFloat16>(slice, slot, r, row_in.data(), y, shrunk.data());
        } else {
          lora_detail::add_row<float>(slice, slot, r, row_in.data(), y, shrunk.data());
        }
      }
    }
  });
}

}  // namespace pagestream
