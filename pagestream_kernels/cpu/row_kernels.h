// The row kernels of a decoder layer, one copy for the torch modules' ops (fused.cpp,
// cache_write.cpp) and the native step (decoder_stack.cpp): RMS norms, gated activations,
// rotary, KV cache writes and elementwise rows, on the one thread team (thread_pool.h).
// Arithmetic is float32; a kernel rounds only where its type arguments say (`Mid`: torch's
// composition rounds there in the weight's dtype; float: nowhere), and each row depends on
// itself alone, so a batch's rows equal the same rows run one by one.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "rows.h"
#include "thread_pool.h"

namespace pagestream {

// Rows per chunk, from the floats of work in a row: a small step (batch-1 decode) stays on
// the calling thread, where waking the team would cost more than the work.
inline int64_t grain(int64_t width) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width));
}

// out = Out(Mid(x * rsqrt(mean(x^2) + eps)) * weight). Mid = the weight's dtype is HF's
// LlamaRMSNorm (hidden.to(weight dtype) * weight); float does not round. x may be out.
template <typename Mid, typename Out>
inline void norm_row(Out* out, const float* x, const float* weight, float* scratch, int64_t h,
                     float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < h; ++i) squares += x[i] * x[i];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) scratch[i] = x[i] * inv;
  round_through<Mid>(scratch, h);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) scratch[i] *= weight[i];
  store_row(out, scratch, h);
}

// out[r] = norm_row(x[r]) for float32 rows [rows, h] (x may be out).
template <typename Mid, typename Out>
void norm_rows(Out* out, const float* x, int64_t rows, int64_t h, const float* weight,
               float eps) {
  parallel_for(rows, grain(h), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(h);
    for (int64_t r = begin; r < end; ++r) {
      norm_row<Mid>(out + r * h, x + r * h, weight, scratch.data(), h, eps);
    }
  });
}

// sum_out[r] = R(residual[r] + x[r]) and out[r] = norm_row<W>(sum_out[r]) (the torch
// modules' residual add fused into their RMSNorm); without a residual (nullptr) out[r] =
// norm_row<W>(x[r]). weight [h] in float32.
template <typename X, typename R, typename W>
void add_norm_rows(W* out, R* sum_out, const R* residual, const X* x, const float* weight,
                   int64_t rows, int64_t h, float eps) {
  parallel_for(rows, grain(h), [&](int64_t begin, int64_t end) {
    std::vector<float> sum(h), other(h), scratch(h);
    for (int64_t r = begin; r < end; ++r) {
      if (residual != nullptr) {
        load_row(sum.data(), residual + r * h, h);
        load_row(other.data(), x + r * h, h);
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) sum[i] += other[i];
        round_through<R>(sum.data(), h);  // the residual add rounds in the residual's dtype
        store_row(sum_out + r * h, sum.data(), h);
      } else {
        load_row(sum.data(), x + r * h, h);
      }
      norm_row<W>(out + r * h, sum.data(), weight, scratch.data(), h, eps);
    }
  });
}

// Each of `heads` heads (head_dim wide, from column 0) of float32 rows `ld` apart normed in
// place with one weight for every head: Qwen3's q_norm / k_norm per head, or (heads = 1,
// head_dim = the width) OLMoE's over all of them.
inline void norm_heads(float* x, int64_t ld, int64_t rows, int64_t heads, int64_t head_dim,
                       const float* weight, float eps) {
  parallel_for(rows, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(head_dim);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        float* head = x + r * ld + h * head_dim;
        norm_row<float>(head, head, weight, scratch.data(), head_dim, eps);
      }
    }
  });
}

// out[r] = Out(Mid(silu(gate)) * up) for gate_up rows [gate | up] of In (torch's silu
// rounds to its dtype before the product: Mid = that dtype; float does not round).
template <typename Mid, typename In, typename Out>
void silu_mul_rows(Out* out, const In* gate_up, int64_t rows, int64_t d) {
  parallel_for(rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    std::vector<float> gate_buffer(d), up_buffer(d), scratch(d);
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = float_row(gate_up + r * 2 * d, gate_buffer.data(), d);
      const float* up = float_row(gate_up + r * 2 * d + d, up_buffer.data(), d);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) scratch[i] = gate[i] / (1.f + std::exp(-gate[i]));
      round_through<Mid>(scratch.data(), d);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) scratch[i] *= up[i];
      store_row(out + r * d, scratch.data(), d);
    }
  });
}

// out[r] = gelu_tanh(gate) * up (PyTorch's tanh approximation) for float32 gate_up rows
// [gate | up], rounded once into Out.
template <typename Out>
void gelu_tanh_mul_rows(Out* out, const float* gate_up, int64_t rows, int64_t d) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  parallel_for(rows, grain(4 * d), [&](int64_t begin, int64_t end) {  // tanh: twice the work
    std::vector<float> scratch(d);
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gate_up + r * 2 * d;
      const float* up = gate + d;
      for (int64_t i = 0; i < d; ++i) {
        const float x = gate[i];
        scratch[i] = 0.5f * x * (1.f + std::tanh(kBeta * (x + kKappa * x * x * x))) * up[i];
      }
      store_row(out + r * d, scratch.data(), d);
    }
  });
}

// HF's rotate_half on the first `rot` features of each head of a float32 row (in and out
// distinct): out = in * cos + rotate_half(in) * sin; the features past rot are copied.
inline void rotate_row(float* out, const float* in, int64_t heads, int64_t head_dim,
                       const float* cos, const float* sin, int64_t rot) {
  const int64_t half = rot / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* a = in + h * head_dim;
    float* o = out + h * head_dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) o[i] = a[i] * cos[i] - a[i + half] * sin[i];
#pragma omp simd
    for (int64_t i = half; i < rot; ++i) o[i] = a[i] * cos[i] + a[i - half] * sin[i];
    for (int64_t i = rot; i < head_dim; ++i) o[i] = a[i];
  }
}

// Rows of `heads` heads of src (In, rows `ld` apart: e.g. a slice of the fused QKV output)
// rotated by cos/sin [rows, rot] (float32) into dst (Out, rows `ld_dst` apart), rounded
// once. dst may be src: each row is read whole before it is written.
template <typename In, typename Out>
void rotary_rows(Out* dst, int64_t ld_dst, const In* src, int64_t ld, int64_t rows,
                 int64_t heads, int64_t head_dim, const float* cos, const float* sin,
                 int64_t rot) {
  const int64_t width = heads * head_dim;
  parallel_for(rows, grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> in(width), res(width);
    for (int64_t r = begin; r < end; ++r) {
      load_row(in.data(), src + r * ld, width);
      rotate_row(res.data(), in.data(), heads, head_dim, cos + r * rot, sin + r * rot, rot);
      store_row(dst + r * ld_dst, res.data(), width);
    }
  });
}

// Keys and values of `rows` rows (S, `key_ld` / `value_ld` apart, `width` = kv_heads *
// head_dim each) into their slots of a cache of C: keys [slots, width], then values
// [slots, width] (kv_cache [2, blocks, block_size, kv_heads, head_dim] contiguous), rounded
// as torch's .to. A negative slot (padding) is not written; distinct rows have distinct
// slots, so the rows may be written in any order.
template <typename S, typename C>
void write_cache_rows(C* cache, int64_t slots, const S* keys, int64_t key_ld, const S* values,
                      int64_t value_ld, int64_t rows, int64_t width, const int64_t* slot_of) {
  C* key_cache = cache;
  C* value_cache = cache + slots * width;
  parallel_for(rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t slot = slot_of[r];
      if (slot < 0) continue;
      convert_row(key_cache + slot * width, keys + r * key_ld, width);
      convert_row(value_cache + slot * width, values + r * value_ld, width);
    }
  });
}

// out [rows, width] = x rounded once into T.
template <typename T>
void round_rows(T* out, const float* x, int64_t rows, int64_t width) {
  parallel_for(rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) store_row(out + r * width, x + r * width, width);
  });
}

// x[i] clamped to [-limit, limit] (OLMoE's clip_qkv).
inline void clamp_rows(float* x, int64_t n, float limit) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = std::min(limit, std::max(-limit, x[i]));
}

// dst [rows, width] += src [rows, width].
inline void add_rows(float* dst, const float* src, int64_t rows, int64_t width) {
  parallel_for(rows, grain(width), [&](int64_t begin, int64_t end) {
    float* d = dst + begin * width;
    const float* s = src + begin * width;
#pragma omp simd
    for (int64_t i = 0; i < (end - begin) * width; ++i) d[i] += s[i];
  });
}

}  // namespace pagestream
