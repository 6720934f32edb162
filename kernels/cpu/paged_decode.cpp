// Decode attention straight from the paged KV cache on the CPU: one query token per sequence.
//
// The torch path gathers every sequence's keys and values into a padded buffer and runs SDPA
// over it, so each cached byte is read, written and read again. Here each
// sequence walks its block table once for the keys and once for the values, reading every cached
// byte once, block by block. float32 only; the caller falls back to the torch path otherwise.
//
// query       [num_seqs, num_q_heads, head_dim]
// key_cache   [num_blocks, block_size, num_kv_heads, head_dim] (value_cache alike)
// block_table [num_seqs, max_blocks] int32
// seq_lens    [num_seqs] int32: context length including this step's token
// out         [num_seqs, num_q_heads, head_dim]
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

struct Layout {
  int64_t num_q_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
};

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// exp(x) for x <= 0 (scores minus their row maximum), vectorisable: 2^(x log2 e) split into
// 2^n (built in the exponent bits) times a degree-6 polynomial for 2^f on [-0.5, 0.5];
// relative error ~2e-7, and exactly 0 below -87 (where float32's exp underflows anyway).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.44269504088896341f;  // log2(e)
  const float n = std::nearbyint(t);
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

inline void axpy(float* y, float alpha, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Calls visit(t, row) for t = 0..n-1, row = the cached token row of position first + t (all kv
// heads, contiguous), walking the block table block by block.
template <typename Visit>
inline void for_each_row(const float* cache, const int32_t* table, int64_t first, int64_t n,
                         const Layout& l, Visit visit) {
  const int64_t token_stride = l.num_kv_heads * l.head_dim;
  for (int64_t pos = first, t = 0; pos < first + n;) {
    const int64_t block = table[pos / l.block_size];
    const int64_t stop = std::min(first + n, (pos / l.block_size + 1) * l.block_size);
    const float* row = cache + (block * l.block_size + pos % l.block_size) * token_stride;
    for (; pos < stop; ++pos, ++t, row += token_stride) visit(t, row);
  }
}

// In place: scale (and soft-cap) one head's scores, then softmax them.
void softmax_row(float* row, int64_t n, float scale, float soft_cap) {
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
  const float inv = 1.f / total;
  for (int64_t t = 0; t < n; ++t) row[t] *= inv;
}

// One sequence: scores [num_q_heads, n] against its keys, softmaxed; then out [num_q_heads,
// head_dim] = scores x values. Each cached row is read once per pass.
void attend_sequence(float* out, float* scores, const float* q, const float* key_cache,
                     const float* value_cache, const int32_t* table, int64_t first, int64_t n,
                     const Layout& l, float scale, float soft_cap) {
  for_each_row(key_cache, table, first, n, l, [&](int64_t t, const float* row) {
    for (int64_t h = 0; h < l.num_q_heads; ++h) {
      scores[h * n + t] = dot(q + h * l.head_dim, row + (h / l.group) * l.head_dim, l.head_dim);
    }
  });
  for (int64_t h = 0; h < l.num_q_heads; ++h) softmax_row(scores + h * n, n, scale, soft_cap);
  std::fill(out, out + l.num_q_heads * l.head_dim, 0.f);
  for_each_row(value_cache, table, first, n, l, [&](int64_t t, const float* row) {
    for (int64_t h = 0; h < l.num_q_heads; ++h) {
      axpy(out + h * l.head_dim, scores[h * n + t], row + (h / l.group) * l.head_dim,
           l.head_dim);
    }
  });
}

}  // namespace

void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                  torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                  double scale, int64_t sliding_window, double soft_cap) {
  for (const auto& t : {out, query, key_cache, value_cache}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                "paged_decode: float32 contiguous CPU tensors only");
  }
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "paged_decode: block_table must be contiguous int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "paged_decode: seq_lens must be contiguous int32");
  const Layout l{query.size(1), key_cache.size(2), query.size(1) / key_cache.size(2),
                 query.size(2),  key_cache.size(1), block_table.size(1)};
  TORCH_CHECK(l.num_q_heads % l.num_kv_heads == 0, "paged_decode: q heads % kv heads != 0");
  const int64_t num_seqs = query.size(0);
  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int32_t* tables = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const int64_t num_blocks = key_cache.size(0);
  for (int64_t seq = 0; seq < num_seqs; ++seq) {  // a bad plan is an error, never a stray read
    const int64_t needed = (static_cast<int64_t>(lens[seq]) + l.block_size - 1) / l.block_size;
    TORCH_CHECK(lens[seq] >= 0 && needed <= l.max_blocks, "paged_decode: sequence ", seq,
                " has length ", lens[seq], ", more than its block table holds");
    for (int64_t b = 0; b < needed; ++b) {
      const int64_t block = tables[seq * l.max_blocks + b];
      TORCH_CHECK(0 <= block && block < num_blocks, "paged_decode: block id ", block,
                  " is out of range [0, ", num_blocks, ")");
    }
  }
  const auto fscale = static_cast<float>(scale);
  const auto fcap = static_cast<float>(soft_cap);
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = lens[seq];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - first;
      float* seq_out = o + seq * l.num_q_heads * l.head_dim;
      if (n <= 0) {
        std::fill(seq_out, seq_out + l.num_q_heads * l.head_dim, 0.f);
        continue;
      }
      const int32_t* table = tables + seq * l.max_blocks;
      scores.resize(l.num_q_heads * n);
      attend_sequence(seq_out, scores.data(), q + seq * l.num_q_heads * l.head_dim, kc, vc, table,
                      first, n, l, fscale, fcap);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV cache (float32)");
}
