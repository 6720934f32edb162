// Attention straight from the paged KV cache on the CPU: decode rows for the torch path's
// `paged_decode` and any step's rows for the native step's `attend_rows`, each row over its
// own causal prefix. Each (sequence, KV head) walks its block table once for the keys and
// once for the values, reading every cached byte once for all the query heads of its GQA
// group (the reference gathers them into a padded buffer first). float32 or bfloat16 queries
// and caches (a bfloat16 cache under float32 queries too), or a uint8 cache of q8_0 rows
// (q8_0.h: int8 codes, a float16 scale per 32), dequantized as it is read: each 16 values
// converted and scaled once into a register that serves every query head of the group, so
// the kernels keep the float caches' structure and read half a bfloat16 cache's bytes. All
// arithmetic is float32.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include "thread_pool.h"

#include "paged_attention.h"
#include "q8_0.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;

// Multiply-adds (query heads x head_dim a cached vector, for its scores and its values) of
// a step's attention below which one thread does it all: waking the thread team costs more
// than a short batch-1 decode's attention. 4096 vectors of SmolLM2-135M's shape (GQA groups
// of 3, head_dim 64); counted in work, not vectors, since a group of 6 heads of 128
// (Qwen2.5-1.5B) does four times as much per vector: its 1,000-token decode row, serial,
// took 107 us a layer on a 2-core Zen 4, a wasted second thread.
constexpr int64_t SERIAL_WORK = 4096 * 3 * 64;
// A row's context is cut into parts at multiples of a part size P, attended apart (in
// parallel) and merged, so one long sequence still keeps every thread busy. P is the power
// of two (at least MIN_PART) nearest above a quarter of the row's span per thread: 2 to 4
// parts per thread. The cut depends on the row's own span (and the process's thread
// count) alone, never on the other rows of the step, so a row's result is the same
// whatever it is batched with: a sequence verifying speculative proposals gets, row for
// row, what its decode steps would (a bfloat16 model rounds activations, so even a last-bit
// difference would change its tokens).
//
// Rows of one sequence whose lengths follow one another (a verification's k + 1 rows, a
// prefill chunk's) and whose cut is the same attend together, up to FOLD rows: each cache
// block is read from memory once for all of them (as the query heads of a GQA group share
// it), and each row's arithmetic is exactly what it would be alone (its own positions of
// the block, its own scores and sums).
constexpr int64_t MIN_PART = 64;
constexpr int64_t FOLD = 8;
// Cache blocks asked for ahead of the one being read (the block after the next is asked
// for while reading this one; the next was asked for a block ago).
constexpr int64_t PREFETCH_BLOCKS = 2;

// row: elements of the cache type a head's vector takes (head_dim; q8_0: its row's bytes).
struct Layout {
  int64_t num_q_heads, num_kv_heads, group, head_dim, block_size, max_blocks, row;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }

// Value i of a cached head vector `row` (head_dim values).
inline float cached_value(const float* row, int64_t i, int64_t) { return row[i]; }
inline float cached_value(const bf16* row, int64_t i, int64_t) { return to_float(row[i]); }
inline float cached_value(const uint8_t* row, int64_t i, int64_t head_dim) {
  return pagestream::q8_0_value(row, head_dim, i);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {  // bfloat16 is the top half of a float32
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// A cached head vector read 16 values at a time (at(c): values c..c+15, c a multiple of
// 16). float32 / bfloat16: straight from the row.
template <typename C>
struct Row16 {
  const C* row;
  static Row16 of(const C* row, int64_t) { return {row}; }
  __m512 at(int64_t c) const { return load16(row + c); }
};

// A q8_0 row: its head_dim / 32 (<= 16) float16 scales converted once, in one masked load,
// so each 16 codes cost a widen, a convert and a multiply by a scale broadcast from memory
// (exact: an int8 times a float16).
template <>
struct Row16<uint8_t> {
  const uint8_t* row;
  alignas(64) float scales[16];
  static Row16 of(const uint8_t* row, int64_t head_dim) {
    Row16 r;
    r.row = row;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const auto mask = static_cast<__mmask16>((1u << (head_dim / 32)) - 1);
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, row + head_dim);
    _mm512_store_ps(r.scales, _mm512_cvtph_ps(bits));
#else
    for (int64_t g = 0; g < head_dim / 32; ++g) r.scales[g] = pagestream::q8_0_scale(row, head_dim, g);
#endif
    return r;
  }
  __m512 at(int64_t c) const {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
    return _mm512_mul_ps(values, _mm512_set1_ps(scales[c / 32]));
  }
};
#endif

// One KV head's vectors in one cache block: `rows` of them at `first`, `stride` elements apart.
template <typename C>
struct BlockRows {
  const C* first;
  int64_t rows, stride;
};

#if defined(__AVX512F__)
// Horizontal sums of KEYS (4 or 8) vectors at once, written to out[0..KEYS): interleave
// pairs within 128-bit lanes, then across lanes, adding as it goes (~3 ops a sum, where
// one _mm512_reduce_add_ps is ~8).
template <int KEYS>
inline void store_sums(float* out, const __m512* x) {
  __m512 a[KEYS / 2];
  for (int k = 0; k < KEYS / 2; ++k) {
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * k], x[2 * k + 1]),
                         _mm512_unpackhi_ps(x[2 * k], x[2 * k + 1]));
  }
  __m512 b[KEYS / 4];  // 128-bit lane L of b[k]: lane L's sums of x[4k .. 4k + 3]
  for (int k = 0; k < KEYS / 4; ++k) {
    b[k] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  if constexpr (KEYS == 8) {
    const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(d, d, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(d, d, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm256_storeu_ps(out, _mm512_castps512_ps256(e));
  } else {
    const __m512 c = _mm512_add_ps(b[0], _mm512_shuffle_f32x4(b[0], b[0], _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 d = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
    _mm_storeu_ps(out, _mm512_castps512_ps128(d));
  }
}

// Keys per pass of score_block for a GQA group of G: the G x KEYS accumulators and the
// group's query chunks must fit the 32 vector registers.
template <int G>
constexpr int keys_per_pass() {
  return G <= 3 ? 8 : (G <= 6 ? 4 : 1);
}
#endif

// scores[j * n + r] = q_j . k_r for the block's rows r and the group's query heads j
// (q: [group, head_dim] float32). G: the group size when known at compile time (1-8, with
// AVX-512 and head_dim % 16 == 0: each key chunk loaded once into a register for all heads
// of the group, several keys per pass with their sums reduced together), else 0 and the
// portable loop.
template <int G, typename C>
inline void score_block(float* scores, int64_t n, const float* q, const BlockRows<C>& b,
                        const Layout& l) {
#if defined(__AVX512F__)
  if constexpr (G > 0) {
    constexpr int KEYS = keys_per_pass<G>();
    const C* row = b.first;
    int64_t r = 0;
    if constexpr (KEYS > 1) {
      for (; r + KEYS <= b.rows; r += KEYS, row += KEYS * b.stride) {
        __m512 acc[G][KEYS];
        Row16<C> keys[KEYS];
        for (int t = 0; t < KEYS; ++t) keys[t] = Row16<C>::of(row + t * b.stride, l.head_dim);
        for (int j = 0; j < G; ++j) {
          for (int t = 0; t < KEYS; ++t) acc[j][t] = _mm512_setzero_ps();
        }
        for (int64_t c = 0; c < l.head_dim; c += 16) {
          __m512 qc[G];
          for (int j = 0; j < G; ++j) qc[j] = _mm512_loadu_ps(q + j * l.head_dim + c);
          for (int t = 0; t < KEYS; ++t) {
            const __m512 k = keys[t].at(c);
            for (int j = 0; j < G; ++j) acc[j][t] = _mm512_fmadd_ps(qc[j], k, acc[j][t]);
          }
        }
        for (int j = 0; j < G; ++j) store_sums<KEYS>(scores + j * n + r, acc[j]);
      }
    }
    for (; r < b.rows; ++r, row += b.stride) {
      __m512 acc[G];
      for (int j = 0; j < G; ++j) acc[j] = _mm512_setzero_ps();
      const Row16<C> key = Row16<C>::of(row, l.head_dim);
      for (int64_t c = 0; c < l.head_dim; c += 16) {
        const __m512 k = key.at(c);
        for (int j = 0; j < G; ++j) {
          acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * l.head_dim + c), k, acc[j]);
        }
      }
      for (int j = 0; j < G; ++j) scores[j * n + r] = _mm512_reduce_add_ps(acc[j]);
    }
    return;
  }
#endif
  const C* row = b.first;
  for (int64_t r = 0; r < b.rows; ++r, row += b.stride) {
    for (int64_t j = 0; j < l.group; ++j) {
      const float* qj = q + j * l.head_dim;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < l.head_dim; ++i) sum += qj[i] * cached_value(row, i, l.head_dim);
      scores[j * n + r] = sum;
    }
  }
}

// Chunks of 16 of a head's accumulators that stay in registers over a block in mix_block:
// the G x CHUNKS accumulators and the CHUNKS values fit the 32 vector registers, and each
// probability, broadcast once, serves CHUNKS products.
template <int G>
constexpr int mix_chunks() {
  return G <= 6 ? 4 : 2;
}

// acc_j += sum_r probs[r * group + j] * v_r for the group's query heads j (acc: [group,
// head_dim] float32; probs: the block's rows' probabilities, a row's group together); with
// G > 0, mix_chunks<G>() chunks of each accumulator stay in registers over the block. Every
// accumulator lane takes its products in row order whatever the chunking.
template <int G, typename C>
inline void mix_block(float* acc, const float* probs, const BlockRows<C>& b, const Layout& l) {
#if defined(__AVX512F__)
  if constexpr (G > 0) {
    constexpr int CH = mix_chunks<G>();
    int64_t c = 0;
    for (; c + 16 * CH <= l.head_dim; c += 16 * CH) {
      __m512 a[G][CH];
      for (int j = 0; j < G; ++j) {
        for (int h = 0; h < CH; ++h) a[j][h] = _mm512_loadu_ps(acc + j * l.head_dim + c + 16 * h);
      }
      const C* row = b.first;
      const float* p = probs;
      for (int64_t r = 0; r < b.rows; ++r, row += b.stride, p += G) {
        const Row16<C> value = Row16<C>::of(row, l.head_dim);
        __m512 v[CH];
        for (int h = 0; h < CH; ++h) v[h] = value.at(c + 16 * h);
        for (int j = 0; j < G; ++j) {
          const __m512 w = _mm512_set1_ps(p[j]);
          for (int h = 0; h < CH; ++h) a[j][h] = _mm512_fmadd_ps(w, v[h], a[j][h]);
        }
      }
      for (int j = 0; j < G; ++j) {
        for (int h = 0; h < CH; ++h) _mm512_storeu_ps(acc + j * l.head_dim + c + 16 * h, a[j][h]);
      }
    }
    for (; c < l.head_dim; c += 16) {  // a head_dim that is no multiple of 16 * CH
      __m512 a[G];
      for (int j = 0; j < G; ++j) a[j] = _mm512_loadu_ps(acc + j * l.head_dim + c);
      const C* row = b.first;
      const float* p = probs;
      for (int64_t r = 0; r < b.rows; ++r, row += b.stride, p += G) {
        const __m512 v = Row16<C>::of(row, l.head_dim).at(c);
        for (int j = 0; j < G; ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), v, a[j]);
      }
      for (int j = 0; j < G; ++j) _mm512_storeu_ps(acc + j * l.head_dim + c, a[j]);
    }
    return;
  }
#endif
  const C* row = b.first;
  for (int64_t r = 0; r < b.rows; ++r, row += b.stride) {
    for (int64_t j = 0; j < l.group; ++j) {
      const float p = probs[r * l.group + j];
      float* a = acc + j * l.head_dim;
#pragma omp simd
      for (int64_t i = 0; i < l.head_dim; ++i) a[i] += p * cached_value(row, i, l.head_dim);
    }
  }
}

// exp(x) for x <= 0 (scores minus their row maximum), vectorisable: 2^(x log2 e) split into
// 2^n (built in the exponent bits) times a degree-6 polynomial for 2^f on [-0.5, 0.5];
// relative error ~2e-7, and exactly 0 below -87 (where float32's exp underflows anyway).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.44269504088896341f;  // log2(e)
  // round to nearest by the 1.5 * 2^23 trick (|t| < 2^22 here): vectorises, where
  // std::nearbyint is a library call per element
  const float n = (t + 12582912.f) - 12582912.f;
  const float f = t - n;  // [-0.5, 0.5]
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x <= -87.f ? 0.f : p * scale;
}

// Asks for a whole cache block (every KV head's vectors of its positions, contiguous) ahead
// of use: blocks sit anywhere in the cache, so the hardware prefetcher, which follows one
// address stream, loses the sequence at every block boundary and each block would start
// with a row of misses.
template <typename C>
inline void prefetch_block(const C* block_start, int64_t rows, const Layout& l) {
  const int64_t bytes = rows * l.num_kv_heads * l.row * static_cast<int64_t>(sizeof(C));
  const char* start = reinterpret_cast<const char*>(block_start);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(start + b);
}

// Calls visit(t, rows) for each cache block holding positions first..first+n-1: rows are
// KV head 0's vectors of positions first+t.. (head h's sit h * l.row further), walking
// the block table and prefetching the next block.
template <typename C, typename Visit>
inline void for_each_block(const C* cache, const int32_t* table, int64_t first, int64_t n,
                           const Layout& l, Visit visit) {
  const int64_t token_stride = l.num_kv_heads * l.row;
  const int64_t block_elems = l.block_size * token_stride;
  const int64_t last = first + n - 1, last_block = last / l.block_size;
  const auto prefetch = [&](int64_t index) {  // block `index` of the table, if it is ours
    if (index > last_block) return;
    const int64_t rows = index < last_block ? l.block_size : last % l.block_size + 1;
    prefetch_block(cache + table[index] * block_elems, rows, l);
  };
  prefetch(first / l.block_size + 1);
  for (int64_t pos = first; pos < first + n;) {
    const int64_t index = pos / l.block_size;
    prefetch(index + PREFETCH_BLOCKS);
    const int64_t stop = std::min(first + n, (index + 1) * l.block_size);
    const C* row = cache + table[index] * block_elems + (pos % l.block_size) * token_stride;
    visit(pos - first, BlockRows<C>{row, stop - pos, token_stride});
    pos = stop;
  }
}

// In place: scale (and soft-cap) one head's scores and exponentiate them against their
// maximum; returns (that maximum, the sum of the exponentials): the softmax is row / sum.
std::pair<float, float> exp_scores(float* row, int64_t n, float scale, float soft_cap) {
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) {
    float x = row[t] * scale;
    if (soft_cap > 0.f) x = soft_cap * std::tanh(x / soft_cap);
    row[t] = x;
    peak = std::max(peak, x);
  }
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; ++t) {
    row[t] = exp_nonpositive(row[t] - peak);
    total += row[t];
  }
  return {peak, total};
}

// Scratch of one thread: the rows' float32 queries, scores [rows][kv_heads, group, n] and
// probabilities [rows][kv_heads, n, group] (a position's group together, as mix_block reads them).
struct Scratch {
  std::vector<float> q, scores, probs;
};

// One part of up to FOLD rows of one sequence: row i attends to the positions [first,
// first + n[i]) (none when n[i] <= 0), every KV head in the same pass over each cache block
// (a block's token rows are contiguous: read once, from memory, for all heads and rows).
// For KV head h, result[i] + h * stride holds acc [group, head_dim] = sum_t exp(s_t -
// peak_j) v_t, unnormalised, then each query head's peak and sum of exponentials, so parts
// of one context can be merged (stride = group * head_dim + 2 * group). Row i's numbers are
// those of a call with it alone: the same blocks, cut at its own last position.
template <int G, typename Q, typename C>
void attend_part(const Q* const* q, const int64_t* n, float* const* result, int64_t count,
                 const C* key_cache, const C* value_cache, const int32_t* table, int64_t first,
                 const Layout& l, float scale, float soft_cap, Scratch& s) {
  const int64_t width = l.group * l.head_dim, stride = width + 2 * l.group;
  const int64_t heads = l.num_kv_heads;
  int64_t longest = 0;
  for (int64_t i = 0; i < count; ++i) {
    longest = std::max(longest, n[i]);
    for (int64_t h = 0; h < heads; ++h) {
      float* r = result[i] + h * stride;
      std::fill(r, r + width, 0.f);
      std::fill(r + width, r + width + l.group, -std::numeric_limits<float>::infinity());
      std::fill(r + width + l.group, r + stride, 0.f);
    }
  }
  if (longest <= 0) return;
  const int64_t row_scores = heads * l.group * longest;  // one row's scores, `longest` apart
  s.q.resize(count * heads * width);
  s.scores.resize(count * row_scores);
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t e = 0; e < heads * width; ++e) s.q[i * heads * width + e] = to_float(q[i][e]);
  }
  const auto each_row = [&](int64_t t, const BlockRows<C>& b, auto&& fn) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t rows = std::min(b.rows, n[i] - t);  // the row's own end cuts the block
      if (rows <= 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        fn(i, h, BlockRows<C>{b.first + h * l.row, rows, b.stride},
           i * row_scores + h * l.group * longest);
      }
    }
  };
  for_each_block(key_cache, table, first, longest, l, [&](int64_t t, const BlockRows<C>& b) {
    each_row(t, b, [&](int64_t i, int64_t h, const BlockRows<C>& rows, int64_t at) {
      score_block<G>(s.scores.data() + at + t, longest, s.q.data() + (i * heads + h) * width,
                     rows, l);
    });
  });
  s.probs.resize(count * row_scores);
  for (int64_t i = 0; i < count; ++i) {
    if (n[i] <= 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      float* r = result[i] + h * stride;
      const int64_t at = i * row_scores + h * l.group * longest;
      for (int64_t j = 0; j < l.group; ++j) {
        float* row = s.scores.data() + at + j * longest;
        std::tie(r[width + j], r[width + l.group + j]) = exp_scores(row, n[i], scale, soft_cap);
        for (int64_t t = 0; t < n[i]; ++t) s.probs[at + t * l.group + j] = row[t];
      }
    }
  }
  for_each_block(value_cache, table, first, longest, l, [&](int64_t t, const BlockRows<C>& b) {
    each_row(t, b, [&](int64_t i, int64_t h, const BlockRows<C>& rows, int64_t at) {
      mix_block<G>(result[i] + h * stride, s.probs.data() + at + t * l.group, rows, l);
    });
  });
}

// out [group, head_dim] of one KV head from `num_parts` partial results of it (acc, peaks,
// totals; see attend_part), `part_stride` floats apart.
template <typename Q>
void merge_parts(Q* out, const float* parts, int64_t num_parts, int64_t part_stride,
                 const Layout& l) {
  const int64_t width = l.group * l.head_dim;
  std::vector<float> sum(l.head_dim);
  for (int64_t j = 0; j < l.group; ++j) {
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < num_parts; ++p) {
      peak = std::max(peak, parts[p * part_stride + width + j]);
    }
    float total = 0.f;
    std::fill(sum.begin(), sum.end(), 0.f);
    for (int64_t p = 0; p < num_parts; ++p) {
      const float* part = parts + p * part_stride;
      const float t = part[width + l.group + j];
      if (t == 0.f) continue;
      const float w = std::exp(part[width + j] - peak);
      total += w * t;
      for (int64_t i = 0; i < l.head_dim; ++i) sum[i] += w * part[j * l.head_dim + i];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t i = 0; i < l.head_dim; ++i) out[j * l.head_dim + i] = static_cast<Q>(sum[i] * inv);
  }
}

// The rows of one step: row r attends to the first row_len[r] positions of sequence
// row_seq[r] (a decode row: its whole context; prefill rows: causal, up to their own
// position; several rows of a decoding sequence: speculative verification alike), or up to
// limit[r] >= len[r] when limits are given (a bidirectional image's tokens see the whole
// image); a sliding window starts from len[r] either way (its own position's window).
struct Rows {
  const int32_t* tables;  // [num_seqs, max_blocks]
  const int32_t* seq;     // [num_rows]
  const int32_t* len;     // [num_rows]
  const int32_t* limit;   // [num_rows], or null: every row's limit is its len
  int64_t num_rows, num_seqs;
  int64_t end(int64_t r) const { return limit ? limit[r] : len[r]; }
};

// A bad plan is an error, never a stray read: every row's sequence and length, then each
// sequence's blocks up to its longest row once (a prefill chunk's rows share them).
void check_plan(const Rows& rows, int64_t num_blocks, const Layout& l) {
  std::vector<int64_t> longest(rows.num_seqs, 0);
  for (int64_t r = 0; r < rows.num_rows; ++r) {
    const int64_t seq = rows.seq[r], len = rows.len[r], end = rows.end(r);
    TORCH_CHECK(0 <= seq && seq < rows.num_seqs, "paged attention: row ", r,
                " names sequence ", seq, " of ", rows.num_seqs);
    TORCH_CHECK(len >= 0 && end >= len, "paged attention: row ", r, " has length ", len,
                " and key limit ", end, " (a limit is at least the length)");
    TORCH_CHECK((end + l.block_size - 1) / l.block_size <= l.max_blocks,
                "paged attention: row ", r, " has length ", end,
                ", more than its block table holds");
    longest[seq] = std::max(longest[seq], end);
  }
  for (int64_t seq = 0; seq < rows.num_seqs; ++seq) {
    const int64_t needed = (longest[seq] + l.block_size - 1) / l.block_size;
    for (int64_t b = 0; b < needed; ++b) {
      const int64_t block = rows.tables[seq * l.max_blocks + b];
      TORCH_CHECK(0 <= block && block < num_blocks, "paged attention: block id ", block,
                  " is out of range [0, ", num_blocks, ")");
    }
  }
}

// Row r's span [first, len) and its cut: part j covers [max(first, j P), min(len, (j + 1) P))
// for j = first / P .. (len - 1) / P (one empty part for an empty span). `len` is the row's
// key limit; the window's first position comes from its causal length.
struct RowCut {
  int64_t first, len, part, first_part, parts;
  static RowCut of(int64_t causal, int64_t len, int64_t sliding_window, int64_t threads) {
    const int64_t first =
        sliding_window > 0 ? std::max<int64_t>(0, causal - sliding_window) : 0;
    int64_t part = MIN_PART;
    while (part * 4 * threads < len - first) part *= 2;
    const int64_t first_part = first / part;
    const int64_t parts = len > first ? (len - 1) / part - first_part + 1 : 1;
    return {first, len, part, first_part, parts};
  }
  int64_t start(int64_t j) const { return std::max(first, j * part); }
  int64_t size(int64_t j) const { return std::min(len, (j + 1) * part) - start(j); }
};

// Tasks are parts of folds of rows (all KV heads of a row together: each cached token row
// is read once; see MIN_PART and FOLD).
template <int G, typename Q, typename C>
void attend_items(Q* o, const Q* q, const C* kc, const C* vc, const Rows& rows,
                  const Layout& l, float scale, int64_t sliding_window, float soft_cap) {
  const int64_t width = l.group * l.head_dim;  // one KV head's query rows
  const int64_t stride = width + 2 * l.group, row_stride = l.num_kv_heads * stride;
  const int64_t num_rows = rows.num_rows, threads = at::get_num_threads();
  std::vector<RowCut> cuts(num_rows);
  std::vector<int64_t> first_result(num_rows + 1, 0);  // row r's parts' results from here
  int64_t work = 0;  // multiply-adds per score and value, all rows together
  for (int64_t r = 0; r < num_rows; ++r) {
    cuts[r] = RowCut::of(rows.len[r], rows.end(r), sliding_window, threads);
    first_result[r + 1] = first_result[r] + cuts[r].parts;
    work += (cuts[r].len - cuts[r].first) * l.num_q_heads * l.head_dim;
  }
  // folds: runs of rows of one sequence, each one longer than the last (or as long: rows of
  // one image under a key limit), cut alike
  struct Task {
    int64_t row, count, part;
  };
  std::vector<Task> tasks;
  for (int64_t r = 0; r < num_rows;) {
    int64_t count = 1;
    while (count < FOLD && r + count < num_rows && rows.seq[r + count] == rows.seq[r] &&
           cuts[r + count].len - cuts[r + count - 1].len <= 1 &&
           cuts[r + count].len >= cuts[r + count - 1].len && cuts[r + count].part == cuts[r].part &&
           cuts[r + count].first == cuts[r].first) {
      ++count;
    }
    const RowCut& longest = cuts[r + count - 1];
    for (int64_t j = 0; j < longest.parts; ++j) tasks.push_back({r, count, longest.first_part + j});
    r += count;
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t grain = work < SERIAL_WORK ? num_tasks : 1;
  // every part's result, written whole by attend_part (kept between calls: no page faults)
  thread_local std::vector<float> partial;
  const int64_t results_size = first_result[num_rows] * row_stride;
  if (partial.size() < static_cast<size_t>(results_size)) partial.resize(results_size);
  float* results = partial.data();  // the pool's threads see the caller's buffer through it
  pagestream::parallel_for(num_tasks, grain, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    const Q* qs[FOLD];
    int64_t ns[FOLD];
    float* outs[FOLD];
    for (int64_t task = begin; task < end; ++task) {
      const Task& t = tasks[task];
      int64_t count = 0;
      for (int64_t i = 0; i < t.count; ++i) {
        const int64_t row = t.row + i;
        const RowCut& cut = cuts[row];
        if (t.part >= cut.first_part + cut.parts) continue;  // ends in an earlier part
        qs[count] = q + row * l.num_kv_heads * width;
        ns[count] = cut.size(t.part);
        outs[count] = results + (first_result[row] + t.part - cut.first_part) * row_stride;
        ++count;
      }
      attend_part<G>(qs, ns, outs, count, kc, vc, rows.tables + rows.seq[t.row] * l.max_blocks,
                     cuts[t.row].start(t.part), l, scale, soft_cap, scratch);
    }
  });
  pagestream::parallel_for(num_rows, grain == 1 ? 1 : num_rows, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t h = 0; h < l.num_kv_heads; ++h) {
        merge_parts(o + (row * l.num_kv_heads + h) * width,
                    results + first_result[row] * row_stride + h * stride, cuts[row].parts,
                    row_stride, l);
      }
    }
  });
}

template <typename Q, typename C>
void attend(Q* out, const Q* query, int64_t num_q_heads, const at::Tensor& key_cache,
            const at::Tensor& value_cache, int64_t max_blocks, const Rows& rows, float scale,
            int64_t sliding_window, float soft_cap) {
  const int64_t row = key_cache.size(3);
  const int64_t head_dim = std::is_same_v<C, uint8_t> ? pagestream::q8_0_head_dim(row) : row;
  TORCH_CHECK(head_dim > 0, "paged attention: a uint8 cache holds q8_0 rows of 34 bytes per 32 "
              "values, not rows of ", row);
  const Layout l{num_q_heads, key_cache.size(2), num_q_heads / key_cache.size(2),
                 head_dim, key_cache.size(1), max_blocks, row};
  TORCH_CHECK(l.num_q_heads % l.num_kv_heads == 0, "paged attention: q heads % kv heads != 0");
  check_plan(rows, key_cache.size(0), l);
  const auto run = [&](auto group) {
    attend_items<decltype(group)::value>(out, query, key_cache.data_ptr<C>(),
                                         value_cache.data_ptr<C>(), rows, l, scale,
                                         sliding_window, soft_cap);
  };
#if defined(__AVX512F__)
  // (Row16 holds up to 16 q8_0 scales: head_dim <= 512)
  if (l.head_dim % 16 == 0 && (!std::is_same_v<C, uint8_t> || l.head_dim <= 512)) {
    switch (l.group) {  // the common GQA group sizes, unrolled; others take the loop
      case 1: return run(std::integral_constant<int, 1>{});
      case 2: return run(std::integral_constant<int, 2>{});
      case 3: return run(std::integral_constant<int, 3>{});
      case 4: return run(std::integral_constant<int, 4>{});
      case 5: return run(std::integral_constant<int, 5>{});
      case 6: return run(std::integral_constant<int, 6>{});
      case 7: return run(std::integral_constant<int, 7>{});
      case 8: return run(std::integral_constant<int, 8>{});
      default: break;
    }
  }
#endif
  run(std::integral_constant<int, 0>{});
}

template <typename Q, typename C>
void decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
            torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor seq_lens,
            float scale, int64_t sliding_window, float soft_cap) {
  const int64_t num_seqs = query.size(0);
  std::vector<int32_t> seq(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) seq[s] = static_cast<int32_t>(s);
  const Rows rows{block_table.data_ptr<int32_t>(), seq.data(), seq_lens.data_ptr<int32_t>(),
                  nullptr, num_seqs, num_seqs};
  attend<Q, C>(out.data_ptr<Q>(), query.data_ptr<Q>(), query.size(1), key_cache, value_cache,
               block_table.size(1), rows, scale, sliding_window, soft_cap);
}

}  // namespace

namespace pagestream {

void attend_rows(float* out, const float* query, int64_t num_q_heads, const at::Tensor& kv_cache,
                 const int32_t* block_table, int64_t num_seqs, int64_t max_blocks,
                 const int32_t* row_seq, const int32_t* row_len, const int32_t* row_limit,
                 int64_t num_rows, float scale, int64_t sliding_window, float soft_cap) {
  const Rows rows{block_table, row_seq, row_len, row_limit, num_rows, num_seqs};
  const auto keys = kv_cache[0], values = kv_cache[1];
  if (kv_cache.scalar_type() == at::kFloat) {
    attend<float, float>(out, query, num_q_heads, keys, values, max_blocks, rows, scale,
                         sliding_window, soft_cap);
  } else if (kv_cache.scalar_type() == at::kByte) {
    attend<float, uint8_t>(out, query, num_q_heads, keys, values, max_blocks, rows, scale,
                           sliding_window, soft_cap);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16, "paged attention: a float32, bfloat16 "
                "or q8_0 (uint8) cache, not ", kv_cache.scalar_type());
    attend<float, bf16>(out, query, num_q_heads, keys, values, max_blocks, rows, scale,
                        sliding_window, soft_cap);
  }
}

}  // namespace pagestream

// Rows of any step (see Rows) over the paged cache: query and out [num_rows, q_heads,
// head_dim] float32, kv_cache [2, blocks, block_size, kv_heads, head_dim] float32 or
// bfloat16 (or uint8 q8_0 rows [.., kv_heads, q8_0_row_bytes(head_dim)]), block_table
// [num_seqs, max_blocks], row_seq / row_len [num_rows] int32;
// row_limit: None (causal) or [num_rows] int32, each row's key limit (see Rows).
void paged_attention_rows(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                          torch::Tensor block_table, torch::Tensor row_seq,
                          torch::Tensor row_len, double scale, int64_t sliding_window,
                          double soft_cap, c10::optional<torch::Tensor> row_limit) {
  const torch::Tensor limit = row_limit.has_value() ? *row_limit : row_len;
  for (const auto& t : {out, query, kv_cache, block_table, row_seq, row_len, limit}) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(),
                "paged_attention_rows: contiguous CPU tensors only");
  }
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  out.sizes() == query.sizes(),
              "paged_attention_rows: float32 query and out of the same shape");
  const bool q8 = kv_cache.scalar_type() == at::kByte;
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 &&
                  kv_cache.size(4) == (q8 ? pagestream::q8_0_row_bytes(query.size(2)) : query.size(2)),
              "paged_attention_rows: the cache's rows must hold the query's head_dim");
  for (const auto& t : {block_table, row_seq, row_len, limit}) {
    TORCH_CHECK(t.scalar_type() == at::kInt, "paged_attention_rows: int32 tables and rows");
  }
  TORCH_CHECK(row_seq.numel() == query.size(0) && row_len.numel() == query.size(0) &&
                  limit.numel() == query.size(0),
              "paged_attention_rows: one row_seq, row_len and row_limit per query row");
  pagestream::attend_rows(out.data_ptr<float>(), query.data_ptr<float>(), query.size(1),
                          kv_cache, block_table.data_ptr<int32_t>(), block_table.size(0),
                          block_table.size(1), row_seq.data_ptr<int32_t>(),
                          row_len.data_ptr<int32_t>(),
                          row_limit.has_value() ? limit.data_ptr<int32_t>() : nullptr,
                          query.size(0),
                          static_cast<float>(scale), sliding_window,
                          static_cast<float>(soft_cap));
}

// Decode rows over the paged cache (the torch path):
// query       [num_seqs, num_q_heads, head_dim]
// key_cache   [num_blocks, block_size, num_kv_heads, head_dim] (value_cache alike), or uint8
//             q8_0 rows [.., num_kv_heads, q8_0_row_bytes(head_dim)]
// block_table [num_seqs, max_blocks] int32
// seq_lens    [num_seqs] int32: context length including this step's token
// out         [num_seqs, num_q_heads, head_dim] (the query's dtype)
void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                  torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                  double scale, int64_t sliding_window, double soft_cap) {
  const auto qtype = query.scalar_type(), ctype = key_cache.scalar_type();
  for (const auto& t : {out, query, key_cache, value_cache}) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(),
                "paged_decode: contiguous CPU tensors only");
  }
  TORCH_CHECK(out.scalar_type() == qtype && value_cache.scalar_type() == ctype,
              "paged_decode: out must match the query's dtype, values the keys'");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "paged_decode: block_table must be contiguous int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "paged_decode: seq_lens must be contiguous int32");
  const bool q8 = ctype == at::kByte;
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 &&
                  key_cache.size(3) == (q8 ? pagestream::q8_0_row_bytes(query.size(2)) : query.size(2)),
              "paged_decode: the cache's rows must hold the query's head_dim");
  const auto s = static_cast<float>(scale);
  const auto cap = static_cast<float>(soft_cap);
  if (qtype == at::kFloat && ctype == at::kByte) {
    decode<float, uint8_t>(out, query, key_cache, value_cache, block_table, seq_lens, s,
                           sliding_window, cap);
  } else if (qtype == at::kBFloat16 && ctype == at::kByte) {
    decode<bf16, uint8_t>(out, query, key_cache, value_cache, block_table, seq_lens, s,
                          sliding_window, cap);
  } else if (qtype == at::kFloat && ctype == at::kFloat) {
    decode<float, float>(out, query, key_cache, value_cache, block_table, seq_lens, s,
                         sliding_window, cap);
  } else if (qtype == at::kBFloat16 && ctype == at::kBFloat16) {
    decode<bf16, bf16>(out, query, key_cache, value_cache, block_table, seq_lens, s,
                       sliding_window, cap);
  } else if (qtype == at::kFloat && ctype == at::kBFloat16) {
    decode<float, bf16>(out, query, key_cache, value_cache, block_table, seq_lens, s,
                        sliding_window, cap);
  } else {
    TORCH_CHECK(false, "paged_decode: query ", qtype, " over a ", ctype,
                " cache is not supported (float32, bfloat16 or q8_0)");
  }
}

