// Attention straight from the paged KV cache on the CPU, one query row at a time: decode
// rows (one query token per sequence) for the torch path's `paged_decode`, and any step's
// rows (prefill chunks, several tokens per decoding sequence) for the native step's
// `attend_rows`, each row over its own causal prefix of the context.
//
// The torch path gathers every sequence's keys and values into a padded buffer and runs SDPA
// over it, so each cached byte is read, written and read again. Here each (sequence, KV head)
// walks its block table once for the keys and once for the values, reading every cached byte
// once, block by block, for all the query heads of its GQA group. float32 or bfloat16 queries
// and caches (a bfloat16 cache under float32 queries too); all arithmetic is float32.
//
// query       [num_seqs, num_q_heads, head_dim]
// key_cache   [num_blocks, block_size, num_kv_heads, head_dim] (value_cache alike)
// block_table [num_seqs, max_blocks] int32
// seq_lens    [num_seqs] int32: context length including this step's token
// out         [num_seqs, num_q_heads, head_dim] (the query's dtype)
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include "thread_pool.h"

#include "paged_attention.h"

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

constexpr int64_t SERIAL_ROWS = 4096;
// A step reading at least this many cached vectors, with fewer (row, KV head) items than
// twice the threads, cuts each item's context into parts of at least MIN_PART positions.
constexpr int64_t SPLIT_VECTORS = 512;
constexpr int64_t MIN_PART = 128;

struct Layout {
  int64_t num_q_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {  // bfloat16 is the top half of a float32
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

// One KV head's vectors in one cache block: `rows` of them at `first`, `stride` elements apart.
template <typename C>
struct BlockRows {
  const C* first;
  int64_t rows, stride;
};

// scores[j * n + r] = q_j . k_r for the block's rows r and the group's query heads j
// (q: [group, head_dim] float32). G: the group size when known at compile time (1-8, with
// AVX-512 and head_dim % 16 == 0: each key chunk loaded once into a register for all heads
// of the group), else 0 and the portable loop.
template <int G, typename C>
inline void score_block(float* scores, int64_t n, const float* q, const BlockRows<C>& b,
                        const Layout& l) {
#if defined(__AVX512F__)
  if constexpr (G > 0) {
    const C* row = b.first;
    for (int64_t r = 0; r < b.rows; ++r, row += b.stride) {
      __m512 acc[G];
      for (int j = 0; j < G; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t c = 0; c < l.head_dim; c += 16) {
        const __m512 k = load16(row + c);
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
      for (int64_t i = 0; i < l.head_dim; ++i) sum += qj[i] * to_float(row[i]);
      scores[j * n + r] = sum;
    }
  }
}

// acc_j += sum_r probs[j * n + r] * v_r for the group's query heads j (acc: [group,
// head_dim] float32); with G > 0 each accumulator chunk stays in a register over the block.
template <int G, typename C>
inline void mix_block(float* acc, const float* probs, int64_t n, const BlockRows<C>& b,
                      const Layout& l) {
#if defined(__AVX512F__)
  if constexpr (G > 0) {
    for (int64_t c = 0; c < l.head_dim; c += 16) {
      __m512 a[G];
      for (int j = 0; j < G; ++j) a[j] = _mm512_loadu_ps(acc + j * l.head_dim + c);
      const C* row = b.first;
      for (int64_t r = 0; r < b.rows; ++r, row += b.stride) {
        const __m512 v = load16(row + c);
        for (int j = 0; j < G; ++j) {
          a[j] = _mm512_fmadd_ps(_mm512_set1_ps(probs[j * n + r]), v, a[j]);
        }
      }
      for (int j = 0; j < G; ++j) _mm512_storeu_ps(acc + j * l.head_dim + c, a[j]);
    }
    return;
  }
#endif
  const C* row = b.first;
  for (int64_t r = 0; r < b.rows; ++r, row += b.stride) {
    for (int64_t j = 0; j < l.group; ++j) {
      const float p = probs[j * n + r];
      float* a = acc + j * l.head_dim;
#pragma omp simd
      for (int64_t i = 0; i < l.head_dim; ++i) a[i] += p * to_float(row[i]);
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

// Asks for one KV head's vectors of a whole cache block ahead of use: blocks sit anywhere
// in the cache, so the hardware prefetcher, which follows one address stream, loses the
// sequence at every block boundary and each block would start with a row of misses.
template <typename C>
inline void prefetch_block(const C* block_start, const Layout& l) {
  const int64_t token_stride = l.num_kv_heads * l.head_dim;
  const int64_t bytes = l.head_dim * static_cast<int64_t>(sizeof(C));
  for (int64_t r = 0; r < l.block_size; ++r) {
    const char* row = reinterpret_cast<const char*>(block_start + r * token_stride);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b);
  }
}

// Calls visit(t, rows) for each cache block holding positions first..first+n-1: rows are
// KV head `head`'s vectors of positions first+t.., walking the block table (and prefetching
// the next block).
template <typename C, typename Visit>
inline void for_each_block(const C* cache, const int32_t* table, int64_t first, int64_t n,
                           int64_t head, const Layout& l, Visit visit) {
  const int64_t token_stride = l.num_kv_heads * l.head_dim;
  const int64_t block_elems = l.block_size * token_stride;
  const int64_t last_block = (first + n - 1) / l.block_size;
  for (int64_t pos = first; pos < first + n;) {
    const int64_t index = pos / l.block_size;
    if (index < last_block) {
      prefetch_block(cache + table[index + 1] * block_elems + head * l.head_dim, l);
    }
    const int64_t stop = std::min(first + n, (index + 1) * l.block_size);
    const C* row = cache + table[index] * block_elems + (pos % l.block_size) * token_stride +
                   head * l.head_dim;
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

// Scratch of one thread: the group's float32 queries and scores [group, n].
struct Scratch {
  std::vector<float> q, scores;
};

// A KV head's share of one row's attention over the positions [first, first + n): acc
// [group, head_dim] = sum_t exp(s_t - peak_j) v_t, unnormalised, with each query head's
// peak and sum of exponentials (so parts of one context can be merged). Each cached
// vector of the head is read once per pass.
template <int G, typename Q, typename C>
void attend_part(const Q* q, const C* key_cache, const C* value_cache, const int32_t* table,
                 int64_t first, int64_t n, int64_t head, const Layout& l, float scale,
                 float soft_cap, Scratch& s, float* acc, float* peaks, float* totals) {
  const int64_t width = l.group * l.head_dim;
  std::fill(acc, acc + width, 0.f);
  if (n <= 0) {
    std::fill(peaks, peaks + l.group, -std::numeric_limits<float>::infinity());
    std::fill(totals, totals + l.group, 0.f);
    return;
  }
  s.q.resize(width);
  s.scores.resize(l.group * n);
  for (int64_t i = 0; i < width; ++i) s.q[i] = to_float(q[i]);
  float* scores = s.scores.data();
  for_each_block(key_cache, table, first, n, head, l, [&](int64_t t, const BlockRows<C>& b) {
    score_block<G>(scores + t, n, s.q.data(), b, l);
  });
  for (int64_t j = 0; j < l.group; ++j) {
    std::tie(peaks[j], totals[j]) = exp_scores(scores + j * n, n, scale, soft_cap);
  }
  for_each_block(value_cache, table, first, n, head, l, [&](int64_t t, const BlockRows<C>& b) {
    mix_block<G>(acc, scores + t, n, b, l);
  });
}

// out [group, head_dim] from `parts` partial results (acc, peaks, totals each; see
// attend_part), laid out [part][width + 2 * group].
template <typename Q>
void merge_parts(Q* out, const float* parts, int64_t num_parts, const Layout& l) {
  const int64_t width = l.group * l.head_dim, stride = width + 2 * l.group;
  for (int64_t j = 0; j < l.group; ++j) {
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < num_parts; ++p) peak = std::max(peak, parts[p * stride + width + j]);
    float total = 0.f;
    std::vector<float> sum(l.head_dim, 0.f);
    for (int64_t p = 0; p < num_parts; ++p) {
      const float* part = parts + p * stride;
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
// position; several rows of a decoding sequence: speculative verification alike).
struct Rows {
  const int32_t* tables;  // [num_seqs, max_blocks]
  const int32_t* seq;     // [num_rows]
  const int32_t* len;     // [num_rows]
  int64_t num_rows, num_seqs;
};

void check_plan(const Rows& rows, int64_t num_blocks, const Layout& l) {
  // a bad plan is an error, never a stray read
  for (int64_t r = 0; r < rows.num_rows; ++r) {
    const int64_t seq = rows.seq[r], len = rows.len[r];
    TORCH_CHECK(0 <= seq && seq < rows.num_seqs, "paged attention: row ", r,
                " names sequence ", seq, " of ", rows.num_seqs);
    const int64_t needed = (len + l.block_size - 1) / l.block_size;
    TORCH_CHECK(len >= 0 && needed <= l.max_blocks, "paged attention: row ", r,
                " has length ", len, ", more than its block table holds");
    for (int64_t b = 0; b < needed; ++b) {
      const int64_t block = rows.tables[seq * l.max_blocks + b];
      TORCH_CHECK(0 <= block && block < num_blocks, "paged attention: block id ", block,
                  " is out of range [0, ", num_blocks, ")");
    }
  }
}

// Work items are (row, KV head) pairs, so one long sequence still keeps every thread busy;
// consecutive items share a row and consecutive rows mostly a sequence, so a thread walks
// the same cached vectors while they are warm. With fewer items than threads (a batch-1
// decode step) each item's context is cut into parts, attended apart and merged.
template <int G, typename Q, typename C>
void attend_items(Q* o, const Q* q, const C* kc, const C* vc, const Rows& rows,
                  const Layout& l, float scale, int64_t sliding_window, float soft_cap) {
  const int64_t width = l.group * l.head_dim;  // one KV head's query rows
  int64_t vectors = 0, longest = 0;  // cached vectors to read, all items together
  for (int64_t r = 0; r < rows.num_rows; ++r) {
    vectors += rows.len[r];
    longest = std::max<int64_t>(longest, rows.len[r]);
  }
  vectors *= l.num_kv_heads;
  const int64_t items = rows.num_rows * l.num_kv_heads;
  const int64_t threads = at::get_num_threads();
  const int64_t parts = vectors < SPLIT_VECTORS || items >= 2 * threads
                            ? 1
                            : std::min((2 * threads + items - 1) / items,
                                       std::max<int64_t>(1, longest / MIN_PART));
  // Waking the thread team costs more than a small step's whole attention (a short batch-1
  // decode reads a few hundred vectors per layer): below SERIAL_ROWS one thread does it.
  const int64_t grain = parts == 1 && vectors < SERIAL_ROWS ? items : 1;
  const int64_t stride = width + 2 * l.group;
  std::vector<float> partial(parts > 1 ? items * parts * stride : 0);
  pagestream::parallel_for(items * parts, grain, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    std::vector<float> own(parts > 1 ? 0 : stride);
    for (int64_t task = begin; task < end; ++task) {
      // head innermost: a thread's run of tasks reads whole cached token rows (every KV
      // head of a position sits side by side) of one row's part of the context
      const int64_t head = task % l.num_kv_heads, row_part = task / l.num_kv_heads;
      const int64_t row = row_part / parts, part = row_part % parts;
      const int64_t item = row * l.num_kv_heads + head;
      const int64_t len = rows.len[row];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t share = (len - first + parts - 1) / parts;
      const int64_t start = std::min(len, first + part * share);
      const int64_t n = std::min(len, start + share) - start;
      float* result = parts > 1 ? partial.data() + (item * parts + part) * stride : own.data();
      attend_part<G>(q + item * width, kc, vc, rows.tables + rows.seq[row] * l.max_blocks, start,
                     n, head, l, scale, soft_cap, scratch, result, result + width,
                     result + width + l.group);
      if (parts == 1) merge_parts(o + item * width, result, 1, l);
    }
  });
  if (parts > 1) {
    for (int64_t item = 0; item < items; ++item) {
      merge_parts(o + item * width, partial.data() + item * parts * stride, parts, l);
    }
  }
}

template <typename Q, typename C>
void attend(Q* out, const Q* query, int64_t num_q_heads, const at::Tensor& key_cache,
            const at::Tensor& value_cache, int64_t max_blocks, const Rows& rows, float scale,
            int64_t sliding_window, float soft_cap) {
  const Layout l{num_q_heads, key_cache.size(2), num_q_heads / key_cache.size(2),
                 key_cache.size(3), key_cache.size(1), max_blocks};
  TORCH_CHECK(l.num_q_heads % l.num_kv_heads == 0, "paged attention: q heads % kv heads != 0");
  check_plan(rows, key_cache.size(0), l);
  const auto run = [&](auto group) {
    attend_items<decltype(group)::value>(out, query, key_cache.data_ptr<C>(),
                                         value_cache.data_ptr<C>(), rows, l, scale,
                                         sliding_window, soft_cap);
  };
#if defined(__AVX512F__)
  if (l.head_dim % 16 == 0) {
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
                  num_seqs, num_seqs};
  attend<Q, C>(out.data_ptr<Q>(), query.data_ptr<Q>(), query.size(1), key_cache, value_cache,
               block_table.size(1), rows, scale, sliding_window, soft_cap);
}

}  // namespace

namespace pagestream {

void attend_rows(float* out, const float* query, int64_t num_q_heads, const at::Tensor& kv_cache,
                 const int32_t* block_table, int64_t num_seqs, int64_t max_blocks,
                 const int32_t* row_seq, const int32_t* row_len, int64_t num_rows, float scale,
                 int64_t sliding_window, float soft_cap) {
  const Rows rows{block_table, row_seq, row_len, num_rows, num_seqs};
  const auto keys = kv_cache[0], values = kv_cache[1];
  if (kv_cache.scalar_type() == at::kFloat) {
    attend<float, float>(out, query, num_q_heads, keys, values, max_blocks, rows, scale,
                         sliding_window, soft_cap);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16,
                "paged attention: a float32 or bfloat16 cache, not ", kv_cache.scalar_type());
    attend<float, bf16>(out, query, num_q_heads, keys, values, max_blocks, rows, scale,
                        sliding_window, soft_cap);
  }
}

}  // namespace pagestream

// Rows of any step (see Rows) over the paged cache: query and out [num_rows, q_heads,
// head_dim] float32, kv_cache [2, blocks, block_size, kv_heads, head_dim] float32 or
// bfloat16, block_table [num_seqs, max_blocks], row_seq / row_len [num_rows] int32.
void paged_attention_rows(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                          torch::Tensor block_table, torch::Tensor row_seq,
                          torch::Tensor row_len, double scale, int64_t sliding_window,
                          double soft_cap) {
  for (const auto& t : {out, query, kv_cache, block_table, row_seq, row_len}) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(),
                "paged_attention_rows: contiguous CPU tensors only");
  }
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  out.sizes() == query.sizes(),
              "paged_attention_rows: float32 query and out of the same shape");
  for (const auto& t : {block_table, row_seq, row_len}) {
    TORCH_CHECK(t.scalar_type() == at::kInt, "paged_attention_rows: int32 tables and rows");
  }
  TORCH_CHECK(row_seq.numel() == query.size(0) && row_len.numel() == query.size(0),
              "paged_attention_rows: one row_seq and row_len per query row");
  pagestream::attend_rows(out.data_ptr<float>(), query.data_ptr<float>(), query.size(1),
                          kv_cache, block_table.data_ptr<int32_t>(), block_table.size(0),
                          block_table.size(1), row_seq.data_ptr<int32_t>(),
                          row_len.data_ptr<int32_t>(), query.size(0),
                          static_cast<float>(scale), sliding_window,
                          static_cast<float>(soft_cap));
}

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
  const auto s = static_cast<float>(scale);
  const auto cap = static_cast<float>(soft_cap);
  if (qtype == at::kFloat && ctype == at::kFloat) {
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
                " cache is not supported (float32 or bfloat16)");
  }
}

