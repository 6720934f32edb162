// Weight-only quantized linears of the native CPU step: 8-, 6- and 4-bit codes in groups
// along K with float16 or float32 scales (and optional mins), float32 activations, float32
// accumulation and outputs (linear.h). GGUF's Q8_0 / Q4_0 / Q4_1, the K-quants and the
// online int8 / int4 formats all arrive as codes and a float scale per group
// (services/worker/layers/quantization) and are packed exactly, as small as their source:
// 8-bit codes that all lie in -32..31 are held as 6 bits, and scales that factor exactly as
// an int8 sub-scale per group times a float16 scale per super-group (a K-quant's d x sc_j,
// checked bit for bit) as 1 byte a group and 2 a super-group. Layout: QuantizedLinear.
#include "linear.h"
#include "thread_pool.h"
#include "weight_buffer.h"

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
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
constexpr int MAX_TILE = 4;       // rows per pass of the few-rows kernels
// Up to FEW_ROWS_* rows the codes are streamed over each block in tiles of MAX_TILE rows,
// every row's accumulators in registers (the tiles after the first re-read the block):
//  - a bfloat16 model on a CPU with VNNI (Zen 4 / 5, Ice Lake and later), up to
//    FEW_ROWS_VNNI rows: the rows are rounded to int8 in blocks of 32 k with a float scale
//    each (as llama.cpp's Q8 activations), and vpdpbusd multiplies 64 codes by them per
//    instruction; the integer sums of a block are scaled once (weight scale x activation
//    scale), the mins are added with the block's float sum of x;
//  - a float32 model (or no VNNI), up to FEW_ROWS_FMA rows: the codes are turned into
//    floats (one FMA with the group's scale and min) and multiplied into float32 rows.
// More rows: each block is de-quantized once into a cache-sized slice in brgemm's layout
// and one micro-GEMM runs over all rows: a bfloat16 slice (and rows) for a bfloat16 model
// on a CPU with bfloat16 dot products, else float32. The bounds: past 8 rows the FMA kernel
// is no faster than brgemm's path; the VNNI kernel is faster than de-quantized bfloat16 at
// every row count, but int8 rows in a prefill lower the agreement of greedy outputs with
// float32's (docs/benchmarks.md), so prefill chunks (over 32 rows) keep bfloat16 rows.
constexpr int64_t FEW_ROWS_FMA = 8;
constexpr int64_t FEW_ROWS_VNNI = 32;
std::atomic<int64_t> vnni_rows{FEW_ROWS_VNNI};  // set_quantized_stream_rows (benchmarks)
constexpr int64_t MIN_ITEM_MACS = 1 << 16;  // smaller items stay on the calling thread

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline float to_float(float v) { return v; }
inline float to_float(half v) { return static_cast<float>(v); }

template <int Bits>
constexpr int64_t unit_k() {  // k's per 64-byte unit of one 16-column chunk
  return Bits == 8 ? 4 : 8;
}

// The offset of the stored unsigned codes (8 bits: code + 128; 6 bits: code + 32)
template <int Bits>
constexpr int code_offset() {
  return Bits == 8 ? 128 : Bits == 6 ? 32 : 0;
}

// ---- group scales -------------------------------------------------------------------------
// A block's scales (or mins) for group g and column c: flat, one S each, or two-level, an
// int8 sub-scale each times a float16 scale per super-group of `per` groups.
template <typename S>
struct FlatView {
  const S* s;
  int64_t nb;
  float at(int64_t g, int64_t c) const { return to_float(s[g * nb + c]); }
};

struct TwoLevelView {
  const int8_t* sub;
  const half* super;
  int64_t nb, per;
  float at(int64_t g, int64_t c) const {
    return to_float(super[(g / per) * nb + c]) * static_cast<float>(sub[g * nb + c]);
  }
};

// The storage of every block's scales, packed from [N][groups] sources.
template <typename S>
class FlatScales {
 public:
  using View = FlatView<S>;
  struct Source {
    const S* s = nullptr;  // [N][groups]
  };
  FlatScales(int64_t np, int64_t groups, int64_t /*per*/) : groups_(groups), v_(np * groups) {}
  View block(int64_t start, int64_t nb) const { return {v_.data() + start * groups_, nb}; }
  int64_t bytes() const { return v_.bytes(); }
  void clear(int64_t start, int64_t nb) {
    std::fill(v_.data() + start * groups_, v_.data() + (start + nb) * groups_, S(0));
  }
  void set(int64_t start, int64_t nb, int64_t c, const Source& src) {  // column start + c
    S* dst = v_.data() + start * groups_;
    for (int64_t g = 0; g < groups_; ++g) dst[g * nb + c] = src.s[(start + c) * groups_ + g];
  }

 private:
  int64_t groups_;
  WeightBuffer<S> v_;
};

class TwoLevelScales {
 public:
  using View = TwoLevelView;
  struct Source {
    const int8_t* sub = nullptr;  // [N][groups]
    const half* super = nullptr;  // [N][groups / per]
  };
  TwoLevelScales(int64_t np, int64_t groups, int64_t per)
      : groups_(groups), per_(per), sub_(np * groups), super_(np * (groups / per)) {}
  View block(int64_t start, int64_t nb) const {
    return {sub_.data() + start * groups_, super_.data() + start * (groups_ / per_), nb, per_};
  }
  int64_t bytes() const { return sub_.bytes() + super_.bytes(); }
  void clear(int64_t start, int64_t nb) {
    std::fill(sub_.data() + start * groups_, sub_.data() + (start + nb) * groups_, int8_t(0));
    const int64_t supers = groups_ / per_;
    std::fill(super_.data() + start * supers, super_.data() + (start + nb) * supers, half(0.f));
  }
  void set(int64_t start, int64_t nb, int64_t c, const Source& src) {
    const int64_t supers = groups_ / per_;
    int8_t* sub = sub_.data() + start * groups_;
    half* super = super_.data() + start * supers;
    for (int64_t g = 0; g < groups_; ++g) sub[g * nb + c] = src.sub[(start + c) * groups_ + g];
    for (int64_t j = 0; j < supers; ++j) super[j * nb + c] = src.super[(start + c) * supers + j];
  }

 private:
  int64_t groups_, per_;
  WeightBuffer<int8_t> sub_;
  WeightBuffer<half> super_;
};

inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// `per` scales as int8 sub-scales times one float16 `super`, every product exact; false if
// `candidate` (rounded to float16) is not such a super-scale.
inline bool factor_with(const float* s, int64_t per, float candidate, int8_t* sub, half* super) {
  const half h(candidate);
  const float f = static_cast<float>(h);
  if (f == 0.f || !std::isfinite(f)) return false;
  for (int64_t j = 0; j < per; ++j) {
    const float q = std::nearbyint(s[j] / f);
    if (!(q >= -128.f && q <= 127.f) || !same_bits(f * q, s[j])) return false;
    sub[j] = static_cast<int8_t>(q);
  }
  *super = h;
  return true;
}

// One super-group's factors. The largest |scale| is the super-scale times the largest
// |sub-scale|: 63 (Q4_K's 6-bit scales and mins, as llama.cpp's quantizer scales them),
// 127 or 128 (Q6_K's int8 scales) first, then every other; both signs (a zero min of Q4_K is
// -(dmin x 0) = -0.0: only a negative super-scale gives it back).
inline bool factor_one(const float* s, int64_t per, int8_t* sub, half* super) {
  float top = 0.f;
  for (int64_t j = 0; j < per; ++j) top = std::max(top, std::fabs(s[j]));
  if (top == 0.f) return factor_with(s, per, 1.f, sub, super) || factor_with(s, per, -1.f, sub, super);
  auto tries = [&](int t) {
    return factor_with(s, per, top / t, sub, super) || factor_with(s, per, -top / t, sub, super);
  };
  if (tries(63) || tries(127) || tries(128)) return true;
  for (int t = 126; t >= 1; --t) {
    if (t != 63 && tries(t)) return true;
  }
  return false;
}

// float32 scales [N][groups] -> int8 sub-scales [N][groups] and float16 super-scales
// [N][groups / per], or false if some super-group does not factor exactly.
bool factor_scales(const float* s, int64_t n, int64_t groups, int64_t per, int8_t* sub,
                   half* super) {
  std::atomic<bool> ok{true};
  const int64_t count = n * (groups / per);
  pagestream::parallel_for(count, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end && ok.load(std::memory_order_relaxed); ++i) {
      if (!factor_one(s + i * per, per, sub + i * per, super + i)) ok = false;
    }
  });
  return ok;
}

// ---- codes -------------------------------------------------------------------------------
// One block's codes: unit u of chunk q, and for 6 bits the plane of high bits after the
// nibbles.
template <int Bits>
struct CodeBlock {
  const uint8_t* base;
  int64_t chunks, high;  // 16-column chunks; byte offset of the 6-bit high plane
  CodeBlock(const uint8_t* b, int64_t nb, int64_t K) : base(b), chunks(nb / 16), high(nb * K / 2) {}
  const uint8_t* unit(int64_t u, int64_t q) const { return base + (u * chunks + q) * 64; }
  const uint8_t* high_unit(int64_t u, int64_t q) const {
    return base + high + ((u / 2) * chunks + q) * 64;
  }
  // the stored code (unsigned) of k, column c
  int code(int64_t k, int64_t c) const {
    constexpr int64_t KU = unit_k<Bits>();
    const int64_t lane = (c / 16) * 64 + (c % 16) * 4 + (k % KU) % 4;
    const uint8_t byte = base[(k / KU) * chunks * 64 + lane];
    if constexpr (Bits == 8) return byte;
    const int nibble = (k % KU) < 4 ? byte & 15 : byte >> 4;
    if constexpr (Bits == 4) return nibble;
    const int shift = 4 * ((k / 8) % 2) + 2 * ((k % 8) / 4);
    const uint8_t hb = base[high + (k / 16) * chunks * 64 + lane];
    return nibble | (((hb >> shift) & 3) << 4);
  }
};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const FlatView<float>& v, int64_t g, int64_t col) {
  return load16(v.s + g * v.nb + col);
}
inline __m512 load16(const FlatView<half>& v, int64_t g, int64_t col) {
  return load16(v.s + g * v.nb + col);
}
inline __m512 load16(const TwoLevelView& v, int64_t g, int64_t col) {
  const __m128i sub = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v.sub + g * v.nb + col));
  return _mm512_mul_ps(load16(v.super + (g / v.per) * v.nb + col),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub)));
}
inline __m512i load_unit(const uint8_t* p) { return _mm512_loadu_si512(p); }

// Unit u of chunk q as unsigned byte codes: 8 bits in lo; 4 and 6 bits k = 8u + j in lo,
// k = 8u + 4 + j in hi (byte j of each lane).
template <int Bits>
inline void unit_bytes(const CodeBlock<Bits>& cb, int64_t u, int64_t q, __m512i& lo, __m512i& hi) {
  const __m512i v = load_unit(cb.unit(u, q));
  if constexpr (Bits == 8) {
    lo = v, hi = v;
    return;
  }
  const __m512i mask = _mm512_set1_epi8(15);
  lo = _mm512_and_si512(v, mask);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  if constexpr (Bits == 6) {  // bits 4-5 from the high plane: shifts within 16-bit lanes,
    const __m512i h = load_unit(cb.high_unit(u, q));  // then each byte's own bits kept
    const __m512i top = _mm512_set1_epi8(0x30);
    const bool odd = u % 2;
    lo = _mm512_or_si512(lo, _mm512_and_si512(odd ? h : _mm512_slli_epi16(h, 4), top));
    hi = _mm512_or_si512(hi, _mm512_and_si512(odd ? _mm512_srli_epi16(h, 2) : _mm512_slli_epi16(h, 2), top));
  }
}

// The codes of one unit as KU float vectors (16 columns each, k = KU u + j), their values.
template <int Bits>
inline void unit_floats(const CodeBlock<Bits>& cb, int64_t u, int64_t q, __m512* w) {
  __m512i lo, hi;
  unit_bytes<Bits>(cb, u, q, lo, hi);
  if constexpr (Bits == 8) {
    const __m512i s = _mm512_xor_si512(lo, _mm512_set1_epi8(static_cast<char>(0x80)));
    w[0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(s, 24), 24));
    w[1] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(s, 16), 24));
    w[2] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(s, 8), 24));
    w[3] = _mm512_cvtepi32_ps(_mm512_srai_epi32(s, 24));
  } else {
    const __m512i byte = _mm512_set1_epi32(0xff);
    const __m512i offset = _mm512_set1_epi32(code_offset<Bits>());
    for (int j = 0; j < 4; ++j) {
      const __m512i a = _mm512_and_si512(_mm512_srli_epi32(lo, 8 * j), byte);
      const __m512i b = _mm512_and_si512(_mm512_srli_epi32(hi, 8 * j), byte);
      w[j] = _mm512_cvtepi32_ps(_mm512_sub_epi32(a, offset));
      w[4 + j] = _mm512_cvtepi32_ps(_mm512_sub_epi32(b, offset));
    }
  }
}

template <bool HasMin>
inline __m512 dequant(__m512 code, __m512 scale, __m512 min) {
  if constexpr (HasMin) return _mm512_fmadd_ps(code, scale, min);
  return _mm512_mul_ps(code, scale);
}

// Group g's scales and mins for chunks [q0, q0 + C) of a block
template <bool HasMin, int C, typename View>
inline void group_scales(const View& scales, const View& mins, int64_t g, int64_t q0, __m512* s,
                         __m512* mn) {
  for (int q = 0; q < C; ++q) {
    s[q] = load16(scales, g, 16 * (q0 + q));
    mn[q] = HasMin ? load16(mins, g, 16 * (q0 + q)) : _mm512_setzero_ps();
  }
}

// out[m, col .. col + 16) (+)= acc[m] + bias, only the `valid` columns of the block stored
template <int MT>
inline void store_columns(const __m512* acc, int64_t stride, float* out, int64_t ld_out,
                          int64_t col, int64_t valid, bool accumulate, const float* bias) {
  if (col >= valid) return;
  const __mmask16 mask = valid - col >= 16 ? __mmask16(0xffff) : __mmask16((1u << (valid - col)) - 1);
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    float* dst = out + m * ld_out + col;
    __m512 v = _mm512_add_ps(acc[m * stride], b);
    if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, dst));
    _mm512_mask_storeu_ps(dst, mask, v);
  }
}

// What one span of a block multiplies: its codes, scales and mins, output columns.
template <int Bits, typename View>
struct Span {
  CodeBlock<Bits> codes;
  View scales, mins;
  int64_t q0, K, group;
  float* out;
  int64_t ld_out, valid;
  bool accumulate;
  const float* bias;
};

// float32 rows (FMA kernel): chunks [q0, q0 + C) of a block for rows x[0..MT)
template <int Bits, typename View, bool HasMin, int MT, int C>
void fma_span(const float* x, int64_t ld_x, const Span<Bits, View>& sp) {
  constexpr int64_t KU = unit_k<Bits>();
  __m512 acc[MT][C];
  for (int m = 0; m < MT; ++m) {
    for (int q = 0; q < C; ++q) acc[m][q] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < sp.K / sp.group; ++g) {
    __m512 s[C], mn[C];
    group_scales<HasMin, C>(sp.scales, sp.mins, g, sp.q0, s, mn);
    for (int64_t u = g * sp.group / KU; u < (g + 1) * sp.group / KU; ++u) {
      for (int q = 0; q < C; ++q) {
        __m512 w[KU];
        unit_floats<Bits>(sp.codes, u, sp.q0 + q, w);
        for (int j = 0; j < KU; ++j) {
          const __m512 wj = dequant<HasMin>(w[j], s[q], mn[q]);
          for (int m = 0; m < MT; ++m) {
            acc[m][q] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ld_x + u * KU + j]), wj, acc[m][q]);
          }
        }
      }
    }
  }
  for (int q = 0; q < C; ++q) {
    store_columns<MT>(&acc[0][q], C, sp.out, sp.ld_out, 16 * (sp.q0 + q), sp.valid, sp.accumulate,
                      sp.bias);
  }
}

// One block of `block` floats rounded to int8 codes (round half to even, as the rounding
// mode leaves it), with the block's scale (max |x| / 127), float sum and code sum.
inline void int8_block(const float* src, int64_t block, int8_t* dst, float& scale, float& total,
                       int32_t& codes_total) {
  if (block % 16 == 0) {  // whole vectors of 16: the common case (blocks of 32 or 16)
    const int64_t n = block / 16;
    __m512 top = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const __m512 v = _mm512_loadu_ps(src + 16 * i);
      top = _mm512_max_ps(top, _mm512_abs_ps(v)), sum = _mm512_add_ps(sum, v);
    }
    const float most = _mm512_reduce_max_ps(top);
    const __m512 inv = _mm512_set1_ps(most > 0.f ? 127.f / most : 0.f);
    __m512i codes = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; ++i) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + 16 * i), inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * i), _mm512_cvtsepi32_epi8(q));
      codes = _mm512_add_epi32(codes, q);
    }
    scale = most / 127.f, total = _mm512_reduce_add_ps(sum);
    codes_total = _mm512_reduce_add_epi32(codes);
    return;
  }
  float most = 0.f;
  total = 0.f;
  for (int64_t i = 0; i < block; ++i) most = std::max(most, std::fabs(src[i])), total += src[i];
  const float inv = most > 0.f ? 127.f / most : 0.f;
  codes_total = 0;
  for (int64_t i = 0; i < block; ++i) {
    dst[i] = static_cast<int8_t>(std::nearbyint(src[i] * inv));
    codes_total += dst[i];
  }
  scale = most / 127.f;
}

// The rows of a VNNI product, rounded to int8 in blocks of `block` k (block divides the
// group): codes [M][K], scale and float sum of x per block, and the sum of the int8 codes
// (the unsigned codes' offset is taken off with it).
struct Int8Rows {
  int64_t block = 32, blocks = 0;
  std::vector<int8_t> codes;
  std::vector<float> scale, sum;
  std::vector<int32_t> code_sum;

  void fill(const float* x, int64_t M, int64_t ld_x, int64_t K) {
    blocks = K / block;
    codes.resize(M * K);
    scale.resize(M * blocks), sum.resize(M * blocks), code_sum.resize(M * blocks);
    pagestream::parallel_for(M, std::max<int64_t>(1, 8192 / K), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t at = m * blocks + b;
          int8_block(x + m * ld_x + b * block, block, codes.data() + m * K + b * block, scale[at],
                     sum[at], code_sum[at]);
        }
      }
    });
  }
};

#if defined(__AVX512VNNI__)
inline __m512i quad(const int8_t* p) {  // 4 int8 codes in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// int8 rows (VNNI kernel): chunks [q0, q0 + C) of a block for rows [row0, row0 + MT) of `rows`
template <int Bits, typename View, bool HasMin, int MT, int C>
void vnni_span(const Int8Rows& rows, int64_t row0, const Span<Bits, View>& sp) {
  constexpr int64_t KU = unit_k<Bits>();
  const int64_t K = sp.K, block = rows.block, per_group = sp.group / block;
  __m512 acc[MT][C];
  for (int m = 0; m < MT; ++m) {
    for (int q = 0; q < C; ++q) acc[m][q] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < K / sp.group; ++g) {
    __m512 s[C], mn[C];
    group_scales<HasMin, C>(sp.scales, sp.mins, g, sp.q0, s, mn);
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m512i isum[MT][C];
      for (int m = 0; m < MT; ++m) {
        for (int q = 0; q < C; ++q) isum[m][q] = _mm512_setzero_si512();
      }
      for (int64_t u = b * block / KU; u < (b + 1) * block / KU; ++u) {
        // each row's int8 codes of this unit, broadcast once for all C chunks (a broadcast
        // per chunk from memory is slower at one row and no faster at more)
        __m512i x_lo[MT], x_hi[MT];
        for (int m = 0; m < MT; ++m) {
          const int8_t* xu = rows.codes.data() + (row0 + m) * K + u * KU;
          x_lo[m] = quad(xu);
          x_hi[m] = Bits == 8 ? x_lo[m] : quad(xu + 4);
        }
        for (int q = 0; q < C; ++q) {
          __m512i lo, hi;
          unit_bytes<Bits>(sp.codes, u, sp.q0 + q, lo, hi);
          for (int m = 0; m < MT; ++m) {
            isum[m][q] = _mm512_dpbusd_epi32(isum[m][q], lo, x_lo[m]);
            if constexpr (Bits != 8) isum[m][q] = _mm512_dpbusd_epi32(isum[m][q], hi, x_hi[m]);
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        const int64_t at = (row0 + m) * rows.blocks + b;
        const __m512 dx = _mm512_set1_ps(rows.scale[at]);
        const __m512 xsum = _mm512_set1_ps(rows.sum[at]);
        const __m512i offset = _mm512_set1_epi32(code_offset<Bits>() * rows.code_sum[at]);
        for (int q = 0; q < C; ++q) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[m][q], offset));
          acc[m][q] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s[q], dx), acc[m][q]);
          if (HasMin) acc[m][q] = _mm512_fmadd_ps(mn[q], xsum, acc[m][q]);
        }
      }
    }
  }
  for (int q = 0; q < C; ++q) {
    store_columns<MT>(&acc[0][q], C, sp.out, sp.ld_out, 16 * (sp.q0 + q), sp.valid, sp.accumulate,
                      sp.bias);
  }
}
#endif

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

constexpr bool vnni_here() {
#if defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

// The source of a packed weight: codes as QuantizedWeight holds them (8 bits: int8 [N, K];
// 4 bits: uint8 [N, K / 2]), scales and mins in the storage's source form.
template <typename Scales>
struct QuantizedSource {
  const uint8_t* codes;
  int64_t source_bits;
  typename Scales::Source scales, mins;
};

// Layout: N is padded to a multiple of 16 and cut into blocks of `block_` columns (the last
// one narrower, a multiple of 16). A block is a sequence of k-units of 16-column chunks,
// [K / KU][nb / 16][16 columns][4 bytes]: lane c of a chunk holds, for 8 bits, the codes of
// k = 4u .. 4u + 3 as unsigned bytes (code ^ 0x80, that is code + 128); for 4 bits, k = 8u + j
// in the low nibble of byte j and k = 8u + 4 + j in its high nibble. 6 bits (code + 32,
// 0..63): the low nibbles as 4 bits, then a plane [K / 16][nb / 16][16 columns][4 bytes] of
// high bits: byte j of lane c in pair p holds bits 4-5 of k = 16p + j, 16p + 4 + j,
// 16p + 8 + j, 16p + 12 + j at bits 0-1, 2-3, 4-5, 6-7. A 64-byte load is one chunk's unit:
// 16 columns by 4 (8 bits) or 8 (4, 6 bits) k's, the operand of a VNNI dot product
// (vpdpbusd: 4 unsigned bytes times 4 signed bytes into each 32-bit lane). Scales and mins
// are [groups][nb] per block (two-level: int8 [groups][nb] and float16 [supers][nb]).
// Bits: the stored codes (4, 6 or 8); Scales: FlatScales<half / float> or TwoLevelScales.
template <int Bits, typename Scales, bool HasMin>
class QuantizedLinear final : public Linear {
  static constexpr int64_t KU = unit_k<Bits>();
  using View = typename Scales::View;

 public:
  QuantizedLinear(int64_t n, int64_t k, const QuantizedSource<Scales>& src, int64_t group,
                  int64_t per_super, const at::Tensor& bias, std::string format, bool bf16_rows)
      : bf16_rows_(bf16_rows && bf16_gemm_here()),
        vnni_(bf16_rows && vnni_here()),
        n_(n),
        k_(k),
        np_(round_up(n_, 16)),
        group_(group),
        groups_(k_ / group),
        format_(std::move(format)),
        codes_(np_ * k_ * Bits / 8),
        scales_(np_, groups_, per_super),
        mins_(HasMin ? np_ : 1, HasMin ? groups_ : per_super, per_super) {
    TORCH_CHECK(group % KU == 0, "quantized linear: ", Bits, "-bit groups must be multiples of ",
                KU, " input features, not ", group);
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    block_ = np_ / 64 >= 4 * threads ? 64 : 32;
    for (const int64_t b : {32, 16, 8, 4}) {  // the int8 rows' block: a divisor of the group
      if (b >= KU && group % b == 0) {
        x_block_ = b;
        break;
      }
    }
    pack(src);
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
    if (M <= (vnni_ ? vnni_rows.load(std::memory_order_relaxed) : FEW_ROWS_FMA)) {
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
  CodeBlock<Bits> block_codes(int64_t start, int64_t nb) const {
    return {codes_.data() + start * k_ * Bits / 8, nb, k_};
  }
  View block_scales(int64_t start, int64_t nb) const { return scales_.block(start, nb); }
  View block_mins(int64_t start, int64_t nb) const {
    return HasMin ? mins_.block(start, nb) : scales_.block(start, nb);  // unread without mins
  }

  // w[start + c, k] in float32
  float value(int64_t start, int64_t nb, int64_t k, int64_t c) const {
    const float code = static_cast<float>(block_codes(start, nb).code(k, c) - code_offset<Bits>());
    const float w = code * block_scales(start, nb).at(k / group_, c);
    return HasMin ? w + block_mins(start, nb).at(k / group_, c) : w;
  }

  // Every block packed on its own, the blocks spread over the thread team.
  void pack(const QuantizedSource<Scales>& src) {
    pagestream::parallel_for(blocks(), 1, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> column(k_);
      for (int64_t blk = begin; blk < end; ++blk) pack_block(blk * block_, src, column);
    });
  }

  // the stored (unsigned) codes of source row `row`, one byte per k
  void source_codes(const QuantizedSource<Scales>& src, int64_t row, uint8_t* dst) const {
    if (src.source_bits == 4) {
      const uint8_t* in = src.codes + row * (k_ / 2);
      for (int64_t j = 0; j < k_ / 2; ++j) dst[2 * j] = in[j] & 15, dst[2 * j + 1] = in[j] >> 4;
      return;
    }
    const int8_t* in = reinterpret_cast<const int8_t*>(src.codes) + row * k_;
    for (int64_t k = 0; k < k_; ++k) dst[k] = static_cast<uint8_t>(in[k] + code_offset<Bits>());
  }

  void pack_block(int64_t start, const QuantizedSource<Scales>& src, std::vector<uint8_t>& column) {
    const int64_t nb = std::min(block_, np_ - start), chunks = nb / 16;
    uint8_t* dst = codes_.data() + start * k_ * Bits / 8;
    std::memset(dst, Bits == 8 ? 0x80 : 0, nb * k_ * Bits / 8);  // padding columns: code 0
    scales_.clear(start, nb);
    if (HasMin) mins_.clear(start, nb);
    for (int64_t c = 0; c < nb && start + c < n_; ++c) {
      source_codes(src, start + c, column.data());
      const uint8_t* e = column.data();
      for (int64_t u = 0; u < k_ / KU; ++u) {
        uint8_t* lane = dst + (u * chunks + c / 16) * 64 + (c % 16) * 4;
        const uint8_t* in = e + u * KU;
        for (int j = 0; j < 4; ++j) {
          lane[j] = Bits == 8 ? in[j] : static_cast<uint8_t>((in[j] & 15) | ((in[j + 4] & 15) << 4));
        }
        if constexpr (Bits == 6) {  // bits 4-5 of k = 8u + j and 8u + 4 + j into the pair's plane
          uint8_t* hb = dst + nb * k_ / 2 + ((u / 2) * chunks + c / 16) * 64 + (c % 16) * 4;
          const int shift = 4 * (u % 2);
          for (int j = 0; j < 4; ++j) {
            hb[j] |= static_cast<uint8_t>(((in[j] >> 4) << shift) | ((in[j + 4] >> 4) << (shift + 2)));
          }
        }
      }
      scales_.set(start, nb, c, src.scales);
      if (HasMin) mins_.set(start, nb, c, src.mins);
    }
  }

#if defined(__AVX512F__)
  // Rows in tiles of up to MAX_TILE, each block streamed once per tile.
  void run_few_rows(const float* a, int64_t M, int64_t ld_x, float* out, int64_t ld_out,
                    bool accumulate) const {
    thread_local Int8Rows int8_rows;
    if (vnni_) int8_rows.block = x_block_, int8_rows.fill(a, M, ld_x, k_);
    const int64_t grain = std::max<int64_t>(1, MIN_ITEM_MACS / (M * block_ * k_));
    const Int8Rows& rows = int8_rows;
    pagestream::parallel_for(blocks(), grain, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t start = blk * block_, nb = std::min(block_, np_ - start);
        for (int64_t row = 0; row < M; row += MAX_TILE) {
          const int64_t mt = std::min<int64_t>(MAX_TILE, M - row);
          tile(rows, a + row * ld_x, ld_x, row, mt, start, nb, out + row * ld_out + start, ld_out,
               accumulate);
        }
      }
    });
  }

  void tile(const Int8Rows& rows, const float* x, int64_t ld_x, int64_t row0, int64_t mt,
            int64_t start, int64_t nb, float* out, int64_t ld_out, bool accumulate) const {
    switch (mt) {
      case 1: return tile_of<1>(rows, x, ld_x, row0, start, nb, out, ld_out, accumulate);
      case 2: return tile_of<2>(rows, x, ld_x, row0, start, nb, out, ld_out, accumulate);
      case 3: return tile_of<3>(rows, x, ld_x, row0, start, nb, out, ld_out, accumulate);
      default: return tile_of<4>(rows, x, ld_x, row0, start, nb, out, ld_out, accumulate);
    }
  }

  template <int MT>
  void tile_of(const Int8Rows& rows, const float* x, int64_t ld_x, int64_t row0, int64_t start,
               int64_t nb, float* out, int64_t ld_out, bool accumulate) const {
    constexpr int C = MT == 1 ? 4 : 2;  // chunks in flight: MT * C accumulators
    Span<Bits, View> sp{block_codes(start, nb), block_scales(start, nb), block_mins(start, nb),
                        0, k_, group_, out, ld_out, std::min(nb, n_ - start), accumulate,
                        has_bias_ ? bias_.data() + start : nullptr};
    const int64_t chunks = nb / 16;
    for (; sp.q0 + C <= chunks; sp.q0 += C) span<MT, C>(rows, x, ld_x, row0, sp);
    for (; sp.q0 < chunks; ++sp.q0) span<MT, 1>(rows, x, ld_x, row0, sp);
  }

  template <int MT, int C>
  void span(const Int8Rows& rows, const float* x, int64_t ld_x, int64_t row0,
            const Span<Bits, View>& sp) const {
#if defined(__AVX512VNNI__)
    if (vnni_) {
      vnni_span<Bits, View, HasMin, MT, C>(rows, row0, sp);
      return;
    }
#endif
    (void)rows, (void)row0;
    fma_span<Bits, View, HasMin, MT, C>(x, ld_x, sp);
  }
#endif

  // Inputs k0 .. k1 of block `start` (nb columns) de-quantized into brgemm's B layout of T:
  // bfloat16 VNNI pairs [(k1 - k0) / 2][nb][2] or float32 [k1 - k0][nb].
  template <typename T>
  void dequantize_block(int64_t start, int64_t nb, int64_t k0, int64_t k1, T* dst) const {
    const CodeBlock<Bits> codes = block_codes(start, nb);
    const View scales = block_scales(start, nb), mins = block_mins(start, nb);
#if defined(__AVX512F__)
    const int64_t chunks = nb / 16;
    for (int64_t u = k0 / KU; u < k1 / KU; ++u) {
      const int64_t g = u * KU / group_;  // a unit lies inside one group
      for (int64_t q = 0; q < chunks; ++q) {
        const __m512 s = load16(scales, g, 16 * q);
        const __m512 m = HasMin ? load16(mins, g, 16 * q) : _mm512_setzero_ps();
        __m512 w[KU];
        unit_floats<Bits>(codes, u, q, w);
        for (int j = 0; j < KU; ++j) w[j] = dequant<HasMin>(w[j], s, m);
        const int64_t k = u * KU - k0;
        if constexpr (std::is_same_v<T, bf16>) {
          auto* out = reinterpret_cast<int32_t*>(dst);  // [K / 2][nb] pairs
          for (int j = 0; j < KU; j += 2) {
            const __m512i pair = _mm512_or_si512(bf16_bits(w[j]), _mm512_slli_epi32(bf16_bits(w[j + 1]), 16));
            _mm512_storeu_si512(out + ((k + j) / 2) * nb + 16 * q, pair);
          }
        } else {
          for (int j = 0; j < KU; ++j) _mm512_storeu_ps(dst + (k + j) * nb + 16 * q, w[j]);
        }
      }
    }
    return;
#endif
    for (int64_t k = k0; k < k1; ++k) {
      for (int64_t c = 0; c < nb; ++c) {
        const float w = value(start, nb, k, c);
        if constexpr (std::is_same_v<T, bf16>) {
          dst[(((k - k0) / 2) * nb + c) * 2 + (k - k0) % 2] = static_cast<bf16>(w);
        } else {
          dst[(k - k0) * nb + c] = w;
        }
      }
    }
  }

  // Inputs per de-quantized slice: a block's whole K while its slice fits L2 with room
  // (Qwen2.5-1.5B's down projection, K = 8960: 1.1 MB of bfloat16 for 64 columns, more
  // than a Zen 4 core's 1 MB L2, so every 32-row tile re-read it from L3), else slices of
  // K_SLICE (whole units and groups) accumulated into the output.
  int64_t k_slice() const {
    constexpr int64_t K_SLICE = 2048;
    return k_ <= K_SLICE || K_SLICE % group_ != 0 ? k_ : K_SLICE;  // slices of whole groups
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
    const int64_t slice = k_slice();
    pagestream::parallel_for(blocks(), 1, [&](int64_t begin, int64_t end) {
      std::vector<T> weights(slice * block_);
      std::vector<float> tile;  // a partial block's outputs, all rows (its columns past N dropped)
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t start = blk * block_, nb = std::min(block_, np_ - start);
        const int64_t valid = std::min(nb, n_ - start);
        if (valid < nb) tile.assign(M * nb, 0.f);
        for (int64_t k0 = 0; k0 < k_; k0 += slice) {
          const int64_t kc = std::min(slice, k_ - k0);
          dequantize_block<T>(start, nb, k0, k0 + kc, weights.data());
          for (int64_t row = 0; row < M; row += ROW_TILE) {
            const int64_t mt = std::min(ROW_TILE, M - row);
            if (valid == nb) {  // straight into out
              cpublas::brgemm(mt, nb, kc, ld, nb, ld_out, accumulate || k0 > 0, x + row * ld + k0,
                              weights.data(), out + row * ld_out + start, vnni);
            } else {
              cpublas::brgemm(mt, nb, kc, ld, nb, nb, k0 > 0, x + row * ld + k0, weights.data(),
                              tile.data() + row * nb, vnni);
            }
          }
        }
        float* c = out + start;
        if (valid == nb) {
          if (has_bias_) add_bias(c, M, nb, ld_out, bias_.data() + start);
          continue;
        }
        for (int64_t r = 0; r < M; ++r) {
          for (int64_t col = 0; col < valid; ++col) {
            const float v = tile[r * nb + col] + bias_[start + col];
            c[r * ld_out + col] = accumulate ? c[r * ld_out + col] + v : v;
          }
        }
      }
      cpublas::brgemm_release(vnni);
    });
  }

  static void add_bias(float* c, int64_t rows, int64_t cols, int64_t ld, const float* b) {
    for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) c[r * ld + j] += b[j];
    }
  }

  bool bf16_rows_;  // many rows: de-quantize to bfloat16 (else float32) for brgemm
  bool vnni_;       // few rows: int8 rows and VNNI dot products (else float32 FMAs)
  int64_t n_, k_, np_, group_, groups_, block_ = 32, x_block_ = 32;
  std::string format_;
  WeightBuffer<uint8_t> codes_;
  Scales scales_, mins_;
  std::vector<float> bias_;
  bool has_bias_ = false;
};

// What make_quantized_linear decided: the stored bits and the scales' form.
struct Packing {
  int64_t n, k, group, source_bits, bits, per_super = 1;
  bool has_mins;
};

template <int Bits, typename Scales>
std::shared_ptr<Linear> with_mins(const Packing& p, const QuantizedSource<Scales>& src,
                                  const at::Tensor& bias, const std::string& format, bool bf16_rows) {
  if (p.has_mins) {
    return std::make_shared<QuantizedLinear<Bits, Scales, true>>(p.n, p.k, src, p.group, p.per_super,
                                                                 bias, format, bf16_rows);
  }
  return std::make_shared<QuantizedLinear<Bits, Scales, false>>(p.n, p.k, src, p.group, p.per_super,
                                                                bias, format, bf16_rows);
}

template <typename Scales>
std::shared_ptr<Linear> with_bits(const Packing& p, const QuantizedSource<Scales>& src,
                                  const at::Tensor& bias, const std::string& format, bool bf16_rows) {
  if (p.bits == 8) return with_mins<8, Scales>(p, src, bias, format, bf16_rows);
  if (p.bits == 6) return with_mins<6, Scales>(p, src, bias, format, bf16_rows);
  return with_mins<4, Scales>(p, src, bias, format, bf16_rows);
}

// 8-bit codes that all fit 6 bits (-32..31) are stored so (K a multiple of 16: whole pairs
// of units in the high plane).
int64_t stored_bits(int64_t bits, const at::Tensor& codes, int64_t k) {
  if (bits != 8 || k % 16 != 0 || codes.numel() == 0) return bits;
  const auto [lo, hi] = at::aminmax(codes);
  return lo.item<int8_t>() >= -32 && hi.item<int8_t>() <= 31 ? 6 : 8;
}

// Float32 scales of groups that tile super-groups of 256 k (the K-quants') in two levels
// where they factor exactly (scales and mins both); else the flat form.
std::shared_ptr<Linear> two_level_or_flat(Packing p, const at::Tensor& codes,
                                          const at::Tensor& scales, const at::Tensor& mins,
                                          const at::Tensor& bias, const std::string& format,
                                          bool bf16_rows) {
  constexpr int64_t SUPER = 256;
  const int64_t groups = p.k / p.group;
  const uint8_t* code_ptr = static_cast<const uint8_t*>(codes.data_ptr());
  if (p.group < SUPER && SUPER % p.group == 0 && p.k % SUPER == 0) {
    p.per_super = SUPER / p.group;
    auto sub = at::empty({p.n, groups}, at::kChar), super = at::empty({p.n, groups / p.per_super}, at::kHalf);
    auto min_sub = at::empty({p.has_mins ? p.n : 0, groups}, at::kChar);
    auto min_super = at::empty({p.has_mins ? p.n : 0, groups / p.per_super}, at::kHalf);
    auto factors = [&](const at::Tensor& s, at::Tensor& lo, at::Tensor& hi) {
      return factor_scales(s.data_ptr<float>(), p.n, groups, p.per_super, lo.data_ptr<int8_t>(),
                           reinterpret_cast<half*>(hi.data_ptr<at::Half>()));
    };
    if (factors(scales, sub, super) && (!p.has_mins || factors(mins, min_sub, min_super))) {
      QuantizedSource<TwoLevelScales> src{code_ptr, p.source_bits, {}, {}};
      src.scales = {sub.data_ptr<int8_t>(), reinterpret_cast<const half*>(super.data_ptr<at::Half>())};
      if (p.has_mins) {
        src.mins = {min_sub.data_ptr<int8_t>(), reinterpret_cast<const half*>(min_super.data_ptr<at::Half>())};
      }
      return with_bits<TwoLevelScales>(p, src, bias, format, bf16_rows);
    }
    p.per_super = 1;
  }
  QuantizedSource<FlatScales<float>> src{code_ptr, p.source_bits, {scales.data_ptr<float>()}, {}};
  if (p.has_mins) src.mins = {mins.data_ptr<float>()};
  return with_bits<FlatScales<float>>(p, src, bias, format, bf16_rows);
}

}  // namespace

int64_t set_quantized_stream_rows(int64_t rows) {
  return vnni_rows.exchange(rows < 0 ? FEW_ROWS_VNNI : rows);
}

std::shared_ptr<Linear> make_quantized_linear(int64_t bits, const at::Tensor& codes_in,
                                              const at::Tensor& scales_in, const at::Tensor& mins_in,
                                              int64_t group, const at::Tensor& bias,
                                              const std::string& format, bool bf16_rows) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized linear: 4 or 8 bits, not ", bits);
  TORCH_CHECK(codes_in.dim() == 2 && codes_in.device().is_cpu(), "quantized linear: CPU codes [N, K']");
  TORCH_CHECK(codes_in.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "quantized linear: ", bits, "-bit codes must be ", bits == 8 ? "int8" : "uint8");
  const int64_t n = codes_in.size(0), k = codes_in.size(1) * (bits == 4 ? 2 : 1);
  TORCH_CHECK(group > 0 && k % group == 0 && (bits == 8 || group % 2 == 0),
              "quantized linear: group ", group, " must divide K = ", k);
  TORCH_CHECK(scales_in.scalar_type() == at::kHalf || scales_in.scalar_type() == at::kFloat,
              "quantized linear: float16 or float32 scales");
  TORCH_CHECK(scales_in.dim() == 2 && scales_in.size(0) == n && scales_in.size(1) == k / group,
              "quantized linear: scales must be [", n, ", ", k / group, "]");
  const bool has_mins = mins_in.defined() && mins_in.numel() > 0;
  if (has_mins) {
    TORCH_CHECK(mins_in.sizes() == scales_in.sizes() && mins_in.scalar_type() == scales_in.scalar_type(),
                "quantized linear: mins must match the scales' shape and dtype");
  }
  const at::Tensor codes = codes_in.contiguous(), scales = scales_in.contiguous();
  const at::Tensor mins = has_mins ? mins_in.contiguous() : mins_in;
  Packing p{n, k, group, bits, stored_bits(bits, codes, k), 1, has_mins};
  if (p.bits == 6 && group % unit_k<6>() != 0) p.bits = 8;  // 6 bits: whole units of 8 k
  const uint8_t* code_ptr = static_cast<const uint8_t*>(codes.data_ptr());
  if (scales.scalar_type() == at::kFloat) {
    return two_level_or_flat(p, codes, scales, mins, bias, format, bf16_rows);
  }
  QuantizedSource<FlatScales<half>> src{code_ptr, bits, {reinterpret_cast<const half*>(scales.data_ptr<at::Half>())}, {}};
  if (has_mins) src.mins = {reinterpret_cast<const half*>(mins.data_ptr<at::Half>())};
  return with_bits<FlatScales<half>>(p, src, bias, format, bf16_rows);
}

}  // namespace pagestream
