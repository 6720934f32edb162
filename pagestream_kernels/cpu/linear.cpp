// Packed linears for the native CPU step, on torch's batch-reduce GEMM micro-kernels
// (at::native::cpublas::brgemm: oneDNN's ukernels, avx512_bf16 dot products or AMX tiles
// for bfloat16, FMA for float32), which accumulate and write float32.
// The weight [N, K] is cut into blocks of BN output columns, each stored as brgemm's B
// operand: bfloat16 in VNNI pairs [K / 2][nb][2], float32 as [K][nb] (nb = BN, or what is
// left for the last block). A call runs (column block, row tile) items over the thread
// team, column blocks outermost, so a thread keeps its block in cache across row tiles
// and each weight byte is read from memory once per call.
#include "linear.h"
#include "thread_pool.h"
#include "weight_buffer.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagestream {
namespace {

using bf16 = c10::BFloat16;
namespace cpublas = at::native::cpublas;

constexpr int64_t ROW_TILE = 32;            // rows per micro-kernel call
constexpr int64_t MIN_ITEM_MACS = 1 << 16;  // smaller items stay on the calling thread
// Up to this many rows (a decode step of a small batch, or a few sequences verifying
// speculative proposals) a product is a stream over the weight at the memory's speed: our
// own register-blocked loop, which keeps the read stream going (brgemm's kernel reached
// about half the read bandwidth at one row), over groups of up to FEW_ROWS_GROUP rows
// while a column block stays in cache. Each row's sums run in the same order whatever the
// number of rows, so a row's output does not depend on the rows beside it: a sequence
// verifying k proposals computes what k + 1 decode steps would, bit for bit.
constexpr int64_t FEW_ROWS = 16;
constexpr int64_t FEW_ROWS_GROUP = 4;

#if defined(__AVX512F__)
// Columns [j, j + 16 C) of one column block of x [M, K] W^T (M <= FEW_ROWS): each row's
// C 16-column accumulators stay in registers over the whole K. b: the block, nb columns
// wide (see Format).
template <typename T, int M, int C>
inline void few_rows_chunk(const T* a, int64_t ld_a, const T* b, int64_t nb, int64_t j,
                           int64_t K, float* c, int64_t ld_c, bool accumulate, const float* bias) {
  __m512 acc[M][C];
  for (int m = 0; m < M; ++m) {
    for (int q = 0; q < C; ++q) acc[m][q] = _mm512_setzero_ps();
  }
  if constexpr (std::is_same_v<T, bf16>) {
#if defined(__AVX512BF16__)
    const auto* bw = reinterpret_cast<const int32_t*>(b);  // [K / 2][nb] bf16 pairs
    const auto* aw = reinterpret_cast<const int32_t*>(a);
    for (int64_t kp = 0; kp < K / 2; ++kp) {
      const int32_t* row = bw + kp * nb + j;
      __m512i w[C];
      for (int q = 0; q < C; ++q) w[q] = _mm512_loadu_si512(row + 16 * q);
      for (int m = 0; m < M; ++m) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(aw[m * (ld_a / 2) + kp]);
        for (int q = 0; q < C; ++q) acc[m][q] = _mm512_dpbf16_ps(acc[m][q], x, (__m512bh)w[q]);
      }
    }
#endif
  } else {
    for (int64_t k = 0; k < K; ++k) {
      const float* row = b + k * nb + j;
      __m512 w[C];
      for (int q = 0; q < C; ++q) w[q] = _mm512_loadu_ps(row + 16 * q);
      for (int m = 0; m < M; ++m) {
        const __m512 x = _mm512_set1_ps(a[m * ld_a + k]);
        for (int q = 0; q < C; ++q) acc[m][q] = _mm512_fmadd_ps(x, w[q], acc[m][q]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int q = 0; q < C; ++q) {
      float* dst = c + m * ld_c + j + 16 * q;
      __m512 v = acc[m][q];
      if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(dst));
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j + 16 * q));
      _mm512_storeu_ps(dst, v);
    }
  }
}

template <typename T, int M>
inline void few_rows_block(const T* a, int64_t ld_a, const T* b, int64_t nb, int64_t K, float* c,
                           int64_t ld_c, bool accumulate, const float* bias) {
  int64_t j = 0;
  for (; j + 64 <= nb; j += 64) few_rows_chunk<T, M, 4>(a, ld_a, b, nb, j, K, c, ld_c, accumulate, bias);
  for (; j < nb; j += 16) few_rows_chunk<T, M, 1>(a, ld_a, b, nb, j, K, c, ld_c, accumulate, bias);
}
#endif

// Whether few_rows_block runs T here (the block widths must be whole 16-column chunks).
template <typename T>
constexpr bool few_rows_kernel() {
#if defined(__AVX512BF16__)
  return true;
#elif defined(__AVX512F__)
  return std::is_same_v<T, float>;
#else
  return false;
#endif
}

template <typename T>
struct Format;

template <>
struct Format<float> {
  static constexpr bool vnni = false;
  static at::ScalarType type() { return at::kFloat; }
  // (k, n) of a block nb columns wide
  static int64_t index(int64_t k, int64_t n, int64_t nb) { return k * nb + n; }
};

template <>
struct Format<bf16> {
  static constexpr bool vnni = true;
  static at::ScalarType type() { return at::kBFloat16; }
  static int64_t index(int64_t k, int64_t n, int64_t nb) { return ((k / 2) * nb + n) * 2 + k % 2; }
};

template <typename T>
class BrgemmLinear final : public Linear {
 public:
  BrgemmLinear(const at::Tensor& weight, const at::Tensor& bias)
      : n_(weight.size(0)), k_(weight.size(1)), packed_(weight.size(0) * weight.size(1)) {
    TORCH_CHECK(!Format<T>::vnni || k_ % 2 == 0, "a bfloat16 linear needs an even in_features");
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    block_ = n_ / 64 >= 4 * threads ? 64 : 32;
    const at::Tensor w = weight.to(Format<T>::type()).contiguous();
    const T* src = w.data_ptr<T>();
    const int64_t blocks = (n_ + block_ - 1) / block_;
    pagestream::parallel_for(blocks, 1, [&](int64_t begin, int64_t end) {  // blocks apart
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t start = blk * block_, nb = std::min(block_, n_ - start);
        T* dst = packed_.data() + start * k_;
        for (int64_t n = 0; n < nb; ++n) {
          for (int64_t k = 0; k < k_; ++k) dst[Format<T>::index(k, n, nb)] = src[(start + n) * k_ + k];
        }
      }
    });
    if (bias.defined() && bias.numel() > 0) {
      const auto b = bias.to(at::kFloat).contiguous();
      bias_.assign(b.data_ptr<float>(), b.data_ptr<float>() + n_);
    }
  }

  at::ScalarType input_type() const override { return Format<T>::type(); }
  int64_t in_features() const override { return k_; }
  int64_t out_features() const override { return n_; }
  int64_t weight_bytes() const override { return packed_.bytes(); }
  std::string format() const override {
    return std::is_same_v<T, bf16> ? "bfloat16" : "float32";
  }

  void gather_rows(const int64_t* ids, int64_t count, float* out) const override {
    for (int64_t i = 0; i < count; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < n_, "gather_rows: row ", ids[i], " of ", n_);
      const int64_t start = ids[i] / block_ * block_, nb = std::min(block_, n_ - start);
      const T* block = packed_.data() + start * k_;
      for (int64_t k = 0; k < k_; ++k) {
        out[i * k_ + k] = static_cast<float>(block[Format<T>::index(k, ids[i] - start, nb)]);
      }
    }
  }

  void run(const void* x, int64_t M, int64_t ld_x, float* out, int64_t ld_out,
           bool accumulate) const override {
    if (M <= 0) return;
    const T* a = static_cast<const T*>(x);
    const int64_t blocks = (n_ + block_ - 1) / block_;
    if (M <= FEW_ROWS && n_ % 16 == 0 && few_rows_kernel<T>()) {
      run_few_rows(a, M, ld_x, out, ld_out, accumulate, blocks);
      return;
    }
    const int64_t tiles = (M + ROW_TILE - 1) / ROW_TILE;
    const int64_t item_macs = std::min(M, ROW_TILE) * block_ * k_;
    const int64_t grain = std::max<int64_t>(1, MIN_ITEM_MACS / item_macs);
    pagestream::parallel_for(blocks * tiles, grain, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t start = (item / tiles) * block_, row = (item % tiles) * ROW_TILE;
        const int64_t nb = std::min(block_, n_ - start), mt = std::min(ROW_TILE, M - row);
        float* c = out + row * ld_out + start;
        cpublas::brgemm(mt, nb, k_, ld_x, nb, ld_out, accumulate, a + row * ld_x,
                        packed_.data() + start * k_, c, Format<T>::vnni);
        if (!bias_.empty()) add_bias(c, mt, nb, ld_out, bias_.data() + start);
      }
      cpublas::brgemm_release(Format<T>::vnni);
    });
  }

 private:
  void run_few_rows(const T* a, int64_t M, int64_t ld_x, float* out, int64_t ld_out,
                    bool accumulate, int64_t blocks) const {
#if defined(__AVX512F__)
    const int64_t grain = std::max<int64_t>(1, MIN_ITEM_MACS / (M * block_ * k_));
    pagestream::parallel_for(blocks, grain, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t start = blk * block_, nb = std::min(block_, n_ - start);
        const T* b = packed_.data() + start * k_;
        float* c = out + start;
        const float* bias = bias_.empty() ? nullptr : bias_.data() + start;
        for (int64_t row = 0; row < M; row += FEW_ROWS_GROUP) {
          const T* x = a + row * ld_x;
          float* o = c + row * ld_out;
          switch (std::min(FEW_ROWS_GROUP, M - row)) {
            case 1: few_rows_block<T, 1>(x, ld_x, b, nb, k_, o, ld_out, accumulate, bias); break;
            case 2: few_rows_block<T, 2>(x, ld_x, b, nb, k_, o, ld_out, accumulate, bias); break;
            case 3: few_rows_block<T, 3>(x, ld_x, b, nb, k_, o, ld_out, accumulate, bias); break;
            default: few_rows_block<T, 4>(x, ld_x, b, nb, k_, o, ld_out, accumulate, bias); break;
          }
        }
      }
    });
#else
    (void)a, (void)M, (void)ld_x, (void)out, (void)ld_out, (void)accumulate, (void)blocks;
#endif
  }

  static void add_bias(float* c, int64_t rows, int64_t cols, int64_t ld, const float* b) {
    for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) c[r * ld + j] += b[j];
    }
  }

  int64_t n_, k_, block_ = 32;
  WeightBuffer<T> packed_;
  std::vector<float> bias_;
};

}  // namespace

std::shared_ptr<Linear> make_linear(const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "make_linear: a CPU [N, K] weight");
  if (weight.scalar_type() == at::kBFloat16) return std::make_shared<BrgemmLinear<bf16>>(weight, bias);
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "make_linear: float32 or bfloat16 weights, not ",
              weight.scalar_type());
  return std::make_shared<BrgemmLinear<float>>(weight, bias);
}

namespace {

class StackedLinear final : public Linear {
 public:
  explicit StackedLinear(std::vector<std::shared_ptr<Linear>> parts) : parts_(std::move(parts)) {
    TORCH_CHECK(!parts_.empty(), "stacked linear: at least one part");
    for (const auto& part : parts_) {
      TORCH_CHECK(part && part->in_features() == parts_[0]->in_features() &&
                      part->input_type() == parts_[0]->input_type(),
                  "stacked linear: every part takes the same input (features and dtype)");
      offsets_.push_back(n_);
      n_ += part->out_features();
    }
  }

  at::ScalarType input_type() const override { return parts_[0]->input_type(); }
  int64_t in_features() const override { return parts_[0]->in_features(); }
  int64_t out_features() const override { return n_; }

  void run(const void* x, int64_t M, int64_t ld_x, float* out, int64_t ld_out,
           bool accumulate) const override {
    for (size_t i = 0; i < parts_.size(); ++i) {
      parts_[i]->run(x, M, ld_x, out + offsets_[i], ld_out, accumulate);
    }
  }

  void gather_rows(const int64_t* ids, int64_t n, float* out) const override {
    const int64_t k = in_features();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < n_, "gather_rows: row ", ids[i], " of ", n_);
      size_t p = parts_.size() - 1;
      while (offsets_[p] > ids[i]) --p;
      const int64_t row = ids[i] - offsets_[p];
      parts_[p]->gather_rows(&row, 1, out + i * k);
    }
  }

  int64_t weight_bytes() const override {
    int64_t bytes = 0;
    for (const auto& part : parts_) bytes += part->weight_bytes();
    return bytes;
  }

  std::string format() const override {
    std::string names;
    for (const auto& part : parts_) {
      const std::string name = part->format();
      if (names.find(name) == std::string::npos) names += (names.empty() ? "" : "+") + name;
    }
    return names;
  }

 private:
  std::vector<std::shared_ptr<Linear>> parts_;
  std::vector<int64_t> offsets_;
  int64_t n_ = 0;
};

}  // namespace

std::shared_ptr<Linear> make_stacked_linear(const std::vector<std::shared_ptr<Linear>>& parts) {
  if (parts.size() == 1) return parts[0];
  return std::make_shared<StackedLinear>(parts);
}

bool linear_supported(at::ScalarType dtype) {
  const int64_t M = 3, N = 40, K = 24;  // a partial column block and a partial row tile
  try {
    const auto w = at::randn({N, K}).to(dtype), x = at::randn({M, K}).to(dtype);
    auto out = at::zeros({M, N});
    make_linear(w, at::Tensor())->run(x.data_ptr(), M, K, out.data_ptr<float>(), N, false);
    const auto ref = at::matmul(x.to(at::kFloat), w.to(at::kFloat).t());
    return at::allclose(out, ref, 1e-4, 1e-4);
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace pagestream
