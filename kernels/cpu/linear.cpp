// Packed linears for the native CPU step, on torch's batch-reduce GEMM micro-kernels
// (at::native::cpublas::brgemm: oneDNN's ukernels, avx512_bf16 dot products or AMX tiles
// for bfloat16, FMA for float32), which accumulate and write float32.
//
// The weight [N, K] is cut into blocks of BN output columns, each stored as brgemm's B
// operand: bfloat16 in VNNI pairs [K / 2][nb][2], float32 as [K][nb] (nb = BN, or what is
// left for the last block). A call runs (column block, row tile) items over the intra-op
// threads, column blocks outermost, so a thread keeps its block in cache across row tiles
// and each weight byte is read from memory once per call.
#include "linear.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace pagestream {
namespace {

using bf16 = c10::BFloat16;
namespace cpublas = at::native::cpublas;

constexpr int64_t ROW_TILE = 32;       // rows per micro-kernel call
constexpr int64_t MIN_ITEM_MACS = 1 << 16;  // smaller items stay on the calling thread

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
      : n_(weight.size(0)), k_(weight.size(1)) {
    TORCH_CHECK(!Format<T>::vnni || k_ % 2 == 0, "a bfloat16 linear needs an even in_features");
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    block_ = n_ / 64 >= 4 * threads ? 64 : 32;
    const at::Tensor w = weight.to(Format<T>::type()).contiguous();
    const T* src = w.data_ptr<T>();
    packed_.resize(n_ * k_);
    for (int64_t start = 0; start < n_; start += block_) {
      const int64_t nb = std::min(block_, n_ - start);
      T* dst = packed_.data() + start * k_;
      for (int64_t n = 0; n < nb; ++n) {
        for (int64_t k = 0; k < k_; ++k) dst[Format<T>::index(k, n, nb)] = src[(start + n) * k_ + k];
      }
    }
    if (bias.defined() && bias.numel() > 0) {
      const auto b = bias.to(at::kFloat).contiguous();
      bias_.assign(b.data_ptr<float>(), b.data_ptr<float>() + n_);
    }
  }

  at::ScalarType input_type() const override { return Format<T>::type(); }
  int64_t in_features() const override { return k_; }
  int64_t out_features() const override { return n_; }

  void run(const void* x, int64_t M, int64_t ld_x, float* out, int64_t ld_out,
           bool accumulate) const override {
    if (M <= 0) return;
    const T* a = static_cast<const T*>(x);
    const int64_t blocks = (n_ + block_ - 1) / block_;
    const int64_t tiles = (M + ROW_TILE - 1) / ROW_TILE;
    const int64_t item_macs = std::min(M, ROW_TILE) * block_ * k_;
    const int64_t grain = std::max<int64_t>(1, MIN_ITEM_MACS / item_macs);
    at::parallel_for(0, blocks * tiles, grain, [&](int64_t begin, int64_t end) {
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
  static void add_bias(float* c, int64_t rows, int64_t cols, int64_t ld, const float* b) {
    for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) c[r * ld + j] += b[j];
    }
  }

  int64_t n_, k_, block_ = 32;
  std::vector<T> packed_;
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
