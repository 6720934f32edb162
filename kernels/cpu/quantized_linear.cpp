// Weight-only quantized linears of the native CPU step: 8-bit and 4-bit codes in groups
// along K with float16 or float32 scales (and optional mins), float32 activations, float32
// accumulation and outputs (linear.h). GGUF's Q8_0 / Q4_0 / Q4_1 and the K-quants, and the
// online int8 / int4 formats, all arrive in this one form (services/worker/layers/quantization).
//
// Layout: N is padded to a multiple of 16 and cut into blocks of `block_` columns (the last
// one narrower). A block stores its codes k-major, [K][nb] int8 or [K / 2][nb] bytes of two
// 4-bit codes (k even in the low nibble), and its scales and mins [groups][nb], so 16
// consecutive columns of one k are one 16-byte (8 bits) or 8-byte (4 bits) load.
//
// Few rows (decode of a small batch): each thread streams its blocks once, turning 16
// codes into floats (convert, then one FMA with the group's scales and mins) and adding
// them into every row's accumulators, which stay in registers over the whole K: the
// weights are read once for all rows at the memory's speed. Many rows: each block is
// de-quantized once into a cache-sized slice in brgemm's layout, and one micro-GEMM runs
// over all rows: a bfloat16 slice (and bfloat16 rows) for a bfloat16 model on a CPU with
// bfloat16 dot products, else float32 (a float32 model gets float32 products throughout).
#include "linear.h"
#include "thread_pool.h"
#include "weight_buffer.h"

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagestream {
namespace {

using bf16 = c10::BFloat16;
using half = c10::Half;
namespace cpublas = at::native::cpublas;

constexpr int64_t ROW_TILE = 32;  // rows per micro-kernel call of the many-rows path
// Up to this many rows the codes are streamed once for all rows (accumulators in
// registers); more rows de-quantize each block once and run brgemm. SmolLM2-135M Q4_1 on a
// 2-core Zen 4 (bench latency): a 16-row decode step takes 37 ms either way (8 or 16 as
// the limit), against 24 ms for bfloat16 weights: both quantized paths are bound by
// float32 FMAs there (one per weight and row), where bfloat16 dot products do two.
constexpr int64_t FEW_ROWS = 16;
constexpr int64_t MIN_ITEM_MACS = 1 << 16;  // smaller items stay on the calling thread

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline float to_float(float v) { return v; }
inline float to_float(half v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// codes of 16 columns: 8 bits: one k; 4 bits: two k's (low and high nibbles)
inline __m512 codes8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void codes4(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}

template <bool HasMin>
inline __m512 dequant(__m512 code, __m512 scale, __m512 min) {
  if constexpr (HasMin) return _mm512_fmadd_ps(code, scale, min);
  return _mm512_mul_ps(code, scale);
}

// Columns [j, j + 16 C) of a block (nb wide) for rows x[0..M): out (+)= x W^T (+ bias);
// `valid` columns of the block exist (the rest is padding, not stored).
template <int Bits, typename S, bool HasMin, int M, int C>
void few_rows_span(const float* x, int64_t ld_x, const uint8_t* codes, const S* scales,
                   const S* mins, int64_t nb, int64_t j, int64_t K, int64_t group, float* out,
                   int64_t ld_out, int64_t valid, bool accumulate, const float* bias) {
  __m512 acc[M][C];
  for (int m = 0; m < M; ++m) {
    for (int q = 0; q < C; ++q) acc[m][q] = _mm512_setzero_ps();
  }
  const int64_t groups = K / group;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 s[C], mn[C];
    for (int q = 0; q < C; ++q) {
      s[q] = load16(scales + g * nb + j + 16 * q);
      mn[q] = HasMin ? load16(mins + g * nb + j + 16 * q) : _mm512_setzero_ps();
    }
    const int64_t k0 = g * group;
    if constexpr (Bits == 8) {
      const int8_t* cp = reinterpret_cast<const int8_t*>(codes) + k0 * nb + j;
      for (int64_t kk = 0; kk < group; ++kk) {
        __m512 w[C];
        for (int q = 0; q < C; ++q) w[q] = dequant<HasMin>(codes8(cp + kk * nb + 16 * q), s[q], mn[q]);
        for (int m = 0; m < M; ++m) {
          const __m512 xb = _mm512_set1_ps(x[m * ld_x + k0 + kk]);
          for (int q = 0; q < C; ++q) acc[m][q] = _mm512_fmadd_ps(xb, w[q], acc[m][q]);
        }
      }
    } else {
      const uint8_t* cp = codes + (k0 / 2) * nb + j;
      for (int64_t kp = 0; kp < group / 2; ++kp) {
        __m512 w0[C], w1[C];
        for (int q = 0; q < C; ++q) {
          __m512 lo, hi;
          codes4(cp + kp * nb + 16 * q, lo, hi);
          w0[q] = dequant<HasMin>(lo, s[q], mn[q]);
          w1[q] = dequant<HasMin>(hi, s[q], mn[q]);
        }
        for (int m = 0; m < M; ++m) {
          const float* xr = x + m * ld_x + k0 + 2 * kp;
          const __m512 x0 = _mm512_set1_ps(xr[0]), x1 = _mm512_set1_ps(xr[1]);
          for (int q = 0; q < C; ++q) {
            acc[m][q] = _mm512_fmadd_ps(x0, w0[q], acc[m][q]);
            acc[m][q] = _mm512_fmadd_ps(x1, w1[q], acc[m][q]);
          }
        }
      }
    }
  }
  for (int q = 0; q < C; ++q) {
    const int64_t col = j + 16 * q;
    if (col >= valid) break;
    const __mmask16 mask = valid - col >= 16 ? __mmask16(0xffff) : __mmask16((1u << (valid - col)) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {
      float* dst = out + m * ld_out + col;
      __m512 v = _mm512_add_ps(acc[m][q], b);
      if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, dst));
      _mm512_mask_storeu_ps(dst, mask, v);
    }
  }
}

template <int Bits, typename S, bool HasMin, int M>
void few_rows_block(const float* x, int64_t ld_x, const uint8_t* codes, const S* scales,
                    const S* mins, int64_t nb, int64_t K, int64_t group, float* out,
                    int64_t ld_out, int64_t valid, bool accumulate, const float* bias) {
  constexpr int C = M <= 2 ? 4 : (M <= 8 ? 2 : 1);  // M * C accumulators in registers
  int64_t j = 0;
  for (; j + 16 * C <= nb; j += 16 * C) {
    few_rows_span<Bits, S, HasMin, M, C>(x, ld_x, codes, scales, mins, nb, j, K, group, out,
                                         ld_out, valid, accumulate, bias);
  }
  for (; j < nb; j += 16) {
    few_rows_span<Bits, S, HasMin, M, 1>(x, ld_x, codes, scales, mins, nb, j, K, group, out,
                                         ld_out, valid, accumulate, bias);
  }
}

// float32 -> bfloat16 bits, round to nearest even (weights are finite)
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
}
#endif

inline bool bf16_gemm_here() {
  static const bool ok = linear_supported(at::kBFloat16);
  return ok;
}

template <int Bits, typename S, bool HasMin>
class QuantizedLinear final : public Linear {
 public:
  QuantizedLinear(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                  int64_t group, const at::Tensor& bias, std::string format, bool bf16_rows)
      : bf16_rows_(bf16_rows && bf16_gemm_here()),
        n_(codes.size(0)),
        k_(codes.size(1) * (Bits == 4 ? 2 : 1)),
        np_(round_up(n_, 16)),
        group_(group),
        groups_(k_ / group),
        format_(std::move(format)),
        codes_(np_ * k_ * Bits / 8),
        scales_(np_ * groups_),
        mins_(HasMin ? np_ * groups_ : 1) {
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    block_ = np_ / 64 >= 4 * threads ? 64 : 32;
    pack(codes.contiguous(), scales.contiguous(), mins);
    bias_.assign(np_, 0.f);
    if (bias.defined() && bias.numel() > 0) {
      const auto b = bias.to(at::kFloat).contiguous();
      std::copy(b.data_ptr<float>(), b.data_ptr<float>() + n_, bias_.begin());
      has_bias_ = true;
    }
  }

  at::ScalarType input_type() const override { return at::kFloat; }
  int64_t in_features() const override { return k_; }
  int64_t out_features() const override { return n_; }
  int64_t weight_bytes() const override {
    return codes_.bytes() + scales_.bytes() + (HasMin ? mins_.bytes() : 0);
  }
  std::string format() const override { return format_; }

  void run(const void* x, int64_t M, int64_t ld_x, float* out, int64_t ld_out,
           bool accumulate) const override {
    if (M <= 0) return;
    const float* a = static_cast<const float*>(x);
#if defined(__AVX512F__)
    if (M <= FEW_ROWS) {
      run_few_rows(a, M, ld_x, out, ld_out, accumulate);
      return;
    }
    if (bf16_rows_) {
      run_many_rows<bf16>(a, M, ld_x, out, ld_out, accumulate);
      return;
    }
#endif
    run_many_rows<float>(a, M, ld_x, out, ld_out, accumulate);
  }

  void gather_rows(const int64_t* ids, int64_t count, float* out) const override {
    for (int64_t i = 0; i < count; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < n_, "gather_rows: row ", ids[i], " of ", n_);
      const int64_t start = ids[i] / block_ * block_, nb = std::min(block_, np_ - start);
      const int64_t c = ids[i] - start;
      for (int64_t k = 0; k < k_; ++k) out[i * k_ + k] = value(start, nb, k, c);
    }
  }

 private:
  int64_t blocks() const { return (np_ + block_ - 1) / block_; }
  const uint8_t* block_codes(int64_t start) const { return codes_.data() + start * k_ * Bits / 8; }
  const S* block_scales(int64_t start) const { return scales_.data() + start * groups_; }
  const S* block_mins(int64_t start) const { return HasMin ? mins_.data() + start * groups_ : nullptr; }

  float code(const uint8_t* block, int64_t nb, int64_t k, int64_t c) const {
    if constexpr (Bits == 8) return static_cast<float>(reinterpret_cast<const int8_t*>(block)[k * nb + c]);
    const uint8_t byte = block[(k / 2) * nb + c];
    return static_cast<float>(k % 2 ? byte >> 4 : byte & 15);
  }

  // w[start + c, k] in float32
  float value(int64_t start, int64_t nb, int64_t k, int64_t c) const {
    const int64_t at = (k / group_) * nb + c;
    const float w = code(block_codes(start), nb, k, c) * to_float(block_scales(start)[at]);
    return HasMin ? w + to_float(block_mins(start)[at]) : w;
  }

  void pack(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins) {
    std::memset(codes_.data(), 0, codes_.bytes());
    std::memset(scales_.data(), 0, scales_.bytes());
    std::memset(mins_.data(), 0, mins_.bytes());
    const uint8_t* src = static_cast<const uint8_t*>(codes.data_ptr());
    const S* sc = scales.data_ptr<S>();
    const S* mn = HasMin ? mins.contiguous().data_ptr<S>() : nullptr;
    const int64_t row_bytes = k_ * Bits / 8, step = Bits == 8 ? 1 : 2;  // k per byte
    for (int64_t start = 0; start < np_; start += block_) {
      const int64_t nb = std::min(block_, np_ - start);
      uint8_t* dst = codes_.data() + start * row_bytes;
      S* dsc = scales_.data() + start * groups_;
      S* dmn = HasMin ? mins_.data() + start * groups_ : nullptr;
      for (int64_t c = 0; c < nb && start + c < n_; ++c) {
        const int64_t n = start + c;
        for (int64_t b = 0; b < row_bytes; ++b) dst[b * nb + c] = src[n * row_bytes + b];
        for (int64_t g = 0; g < groups_; ++g) {
          dsc[g * nb + c] = sc[n * groups_ + g];
          if (HasMin) dmn[g * nb + c] = mn[n * groups_ + g];
        }
      }
      (void)step;
    }
  }

#if defined(__AVX512F__)
  void run_few_rows(const float* a, int64_t M, int64_t ld_x, float* out, int64_t ld_out,
                    bool accumulate) const {
    const int64_t grain = std::max<int64_t>(1, MIN_ITEM_MACS / (M * block_ * k_));
    pagestream::parallel_for(blocks(), grain, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t start = blk * block_, nb = std::min(block_, np_ - start);
        const uint8_t* c = block_codes(start);
        const S* s = block_scales(start);
        const S* m = block_mins(start);
        const float* bias = has_bias_ ? bias_.data() + start : nullptr;
        float* o = out + start;
        const int64_t valid = std::min(nb, n_ - start);
        switch (M) {
#define PAGESTREAM_FEW(R)                                                                      \
  case R:                                                                                      \
    few_rows_block<Bits, S, HasMin, R>(a, ld_x, c, s, m, nb, k_, group_, o, ld_out, valid,     \
                                       accumulate, bias);                                      \
    break;
          PAGESTREAM_FEW(1)
          PAGESTREAM_FEW(2)
          PAGESTREAM_FEW(3)
          PAGESTREAM_FEW(4)
          PAGESTREAM_FEW(5)
          PAGESTREAM_FEW(6)
          PAGESTREAM_FEW(7)
          PAGESTREAM_FEW(8)
          PAGESTREAM_FEW(9)
          PAGESTREAM_FEW(10)
          PAGESTREAM_FEW(11)
          PAGESTREAM_FEW(12)
          PAGESTREAM_FEW(13)
          PAGESTREAM_FEW(14)
          PAGESTREAM_FEW(15)
          default: PAGESTREAM_FEW(16)
#undef PAGESTREAM_FEW
        }
      }
    });
  }
#endif

  // Block `start` (nb columns) de-quantized into brgemm's B layout of T: bfloat16 VNNI
  // pairs [K / 2][nb][2] or float32 [K][nb].
  template <typename T>
  void dequantize_block(int64_t start, int64_t nb, T* dst) const {
    const uint8_t* codes = block_codes(start);
    const S* scales = block_scales(start);
    const S* mins = block_mins(start);
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, bf16>) {
      auto* out = reinterpret_cast<int32_t*>(dst);  // [K / 2][nb] pairs
      for (int64_t k = 0; k < k_; k += 2) {
        const int64_t g = k / group_;
        for (int64_t c = 0; c < nb; c += 16) {
          const __m512 s = load16(scales + g * nb + c);
          const __m512 m = HasMin ? load16(mins + g * nb + c) : _mm512_setzero_ps();
          __m512 lo, hi;
          if constexpr (Bits == 8) {
            const auto* cp = reinterpret_cast<const int8_t*>(codes);
            lo = codes8(cp + k * nb + c), hi = codes8(cp + (k + 1) * nb + c);
          } else {
            codes4(codes + (k / 2) * nb + c, lo, hi);
          }
          const __m512i pair = _mm512_or_si512(bf16_bits(dequant<HasMin>(lo, s, m)),
                                               _mm512_slli_epi32(bf16_bits(dequant<HasMin>(hi, s, m)), 16));
          _mm512_storeu_si512(out + (k / 2) * nb + c, pair);
        }
      }
      return;
    }
#endif
    for (int64_t k = 0; k < k_; ++k) {
      for (int64_t c = 0; c < nb; ++c) {
        const int64_t at = (k / group_) * nb + c;
        float w = code(codes, nb, k, c) * to_float(scales[at]);
        if (HasMin) w += to_float(mins[at]);
        if constexpr (std::is_same_v<T, bf16>) {
          dst[((k / 2) * nb + c) * 2 + k % 2] = static_cast<bf16>(w);
        } else {
          dst[k * nb + c] = w;
        }
      }
    }
  }

  template <typename T>
  void run_many_rows(const float* a, int64_t M, int64_t ld_x, float* out, int64_t ld_out,
                     bool accumulate) const {
    constexpr bool vnni = std::is_same_v<T, bf16>;
    // the rows in T, once for every block
    std::vector<T> rounded;
    const T* x = nullptr;
    int64_t ld = ld_x;
    if constexpr (std::is_same_v<T, float>) {
      x = a;
    } else {
      rounded.resize(M * k_);
      pagestream::parallel_for(M, std::max<int64_t>(1, 16384 / k_), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          for (int64_t k = 0; k < k_; ++k) rounded[r * k_ + k] = static_cast<T>(a[r * ld_x + k]);
        }
      });
      x = rounded.data(), ld = k_;
    }
    pagestream::parallel_for(blocks(), 1, [&](int64_t begin, int64_t end) {
      std::vector<T> weights(k_ * block_);
      std::vector<float> tile(ROW_TILE * block_);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t start = blk * block_, nb = std::min(block_, np_ - start);
        const int64_t valid = std::min(nb, n_ - start);
        dequantize_block<T>(start, nb, weights.data());
        for (int64_t row = 0; row < M; row += ROW_TILE) {
          const int64_t mt = std::min(ROW_TILE, M - row);
          float* c = out + row * ld_out + start;
          if (valid == nb) {  // straight into out
            cpublas::brgemm(mt, nb, k_, ld, nb, ld_out, accumulate, x + row * ld, weights.data(), c, vnni);
            if (has_bias_) add_bias(c, mt, nb, ld_out, bias_.data() + start, false);
            continue;
          }
          cpublas::brgemm(mt, nb, k_, ld, nb, nb, false, x + row * ld, weights.data(), tile.data(), vnni);
          for (int64_t r = 0; r < mt; ++r) {
            for (int64_t col = 0; col < valid; ++col) {
              const float v = tile[r * nb + col] + bias_[start + col];
              c[r * ld_out + col] = accumulate ? c[r * ld_out + col] + v : v;
            }
          }
        }
      }
      cpublas::brgemm_release(vnni);
    });
  }

  static void add_bias(float* c, int64_t rows, int64_t cols, int64_t ld, const float* b, bool) {
    for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) c[r * ld + j] += b[j];
    }
  }

  bool bf16_rows_;  // many rows: de-quantize to bfloat16 (else float32) for brgemm
  int64_t n_, k_, np_, group_, groups_, block_ = 32;
  std::string format_;
  WeightBuffer<uint8_t> codes_;
  WeightBuffer<S> scales_, mins_;
  std::vector<float> bias_;
  bool has_bias_ = false;
};

template <int Bits, typename S>
std::shared_ptr<Linear> with_mins(bool has_mins, const at::Tensor& codes, const at::Tensor& scales,
                                  const at::Tensor& mins, int64_t group, const at::Tensor& bias,
                                  const std::string& format, bool bf16_rows) {
  if (has_mins) {
    return std::make_shared<QuantizedLinear<Bits, S, true>>(codes, scales, mins, group, bias, format, bf16_rows);
  }
  return std::make_shared<QuantizedLinear<Bits, S, false>>(codes, scales, mins, group, bias, format, bf16_rows);
}

template <int Bits>
std::shared_ptr<Linear> with_scales(const at::Tensor& codes, const at::Tensor& scales,
                                    const at::Tensor& mins, int64_t group, const at::Tensor& bias,
                                    const std::string& format, bool bf16_rows) {
  const bool has_mins = mins.defined() && mins.numel() > 0;
  if (scales.scalar_type() == at::kHalf) {
    return with_mins<Bits, half>(has_mins, codes, scales, mins, group, bias, format, bf16_rows);
  }
  return with_mins<Bits, float>(has_mins, codes, scales, mins, group, bias, format, bf16_rows);
}

}  // namespace

std::shared_ptr<Linear> make_quantized_linear(int64_t bits, const at::Tensor& codes,
                                              const at::Tensor& scales, const at::Tensor& mins,
                                              int64_t group, const at::Tensor& bias,
                                              const std::string& format, bool bf16_rows) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized linear: 4 or 8 bits, not ", bits);
  TORCH_CHECK(codes.dim() == 2 && codes.device().is_cpu(), "quantized linear: CPU codes [N, K']");
  TORCH_CHECK(codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "quantized linear: ", bits, "-bit codes must be ", bits == 8 ? "int8" : "uint8");
  const int64_t n = codes.size(0), k = codes.size(1) * (bits == 4 ? 2 : 1);
  TORCH_CHECK(group > 0 && k % group == 0 && (bits == 8 || group % 2 == 0),
              "quantized linear: group ", group, " must divide K = ", k);
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat,
              "quantized linear: float16 or float32 scales");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == k / group,
              "quantized linear: scales must be [", n, ", ", k / group, "]");
  if (mins.defined() && mins.numel() > 0) {
    TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == scales.scalar_type(),
                "quantized linear: mins must match the scales' shape and dtype");
  }
  if (bits == 8) return with_scales<8>(codes, scales, mins, group, bias, format, bf16_rows);
  return with_scales<4>(codes, scales, mins, group, bias, format, bf16_rows);
}

}  // namespace pagestream
