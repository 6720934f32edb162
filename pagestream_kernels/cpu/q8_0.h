// The q8_0 KV cache rows (pagestream_kernels/q8_0.py has the layout and the torch
// reference, bit-exact with these): a head's head_dim values as head_dim int8 codes, then
// head_dim / 32 float16 scales. Writes quantize here; paged_decode.cpp reads them back.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "row_kernels.h"

namespace pagestream {

constexpr int64_t Q8_GROUP = 32;

// A head's row: head_dim codes and head_dim / 32 two-byte scales.
inline int64_t q8_0_row_bytes(int64_t head_dim) { return head_dim + head_dim / Q8_GROUP * 2; }

// The head_dim of rows `width` bytes wide (34 per 32 values), or 0 when none has that width.
inline int64_t q8_0_head_dim(int64_t width) {
  return width > 0 && width % (Q8_GROUP + 2) == 0 ? width / (Q8_GROUP + 2) * Q8_GROUP : 0;
}

// Scale g of a row of head_dim codes, as float32 (exact).
inline float q8_0_scale(const uint8_t* row, int64_t head_dim, int64_t g) {
  uint16_t bits;
  std::memcpy(&bits, row + head_dim + 2 * g, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction, in the attention kernels' inner loops
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Value i of a row, dequantized (exact in float32).
inline float q8_0_value(const uint8_t* row, int64_t head_dim, int64_t i) {
  return static_cast<float>(static_cast<int8_t>(row[i])) * q8_0_scale(row, head_dim, i / Q8_GROUP);
}

// out (q8_0_row_bytes(head_dim)) = x [head_dim] quantized: per 32 values d = max|x| / 127,
// codes roundf(x / d) through the float32 reciprocal (llama.cpp's arithmetic), d as float16.
// A group holding a NaN or an infinity keeps codes 0 and a NaN scale: it reads back as NaN,
// as a float cache would pass it on (never a cast of NaN to int8, which is undefined).
inline void quantize_q8_0(uint8_t* out, const float* x, int64_t head_dim) {
  for (int64_t g = 0; g < head_dim / Q8_GROUP; ++g) {
    const float* v = x + g * Q8_GROUP;
    float peak = 0.f;
    bool finite = true;
    for (int64_t i = 0; i < Q8_GROUP; ++i) {
      const float magnitude = std::fabs(v[i]);
      finite = finite && std::isfinite(magnitude);
      peak = std::max(peak, magnitude);
    }
    const float d = finite ? peak / 127.f : std::numeric_limits<float>::quiet_NaN();
    const float inverse = finite && d > 0.f ? 1.f / d : 0.f;
    for (int64_t i = 0; i < Q8_GROUP; ++i) {
      const float code = finite ? std::round(v[i] * inverse) : 0.f;
      out[g * Q8_GROUP + i] = static_cast<uint8_t>(static_cast<int8_t>(code));
    }
    const uint16_t bits = c10::Half(d).x;
    std::memcpy(out + head_dim + 2 * g, &bits, sizeof(bits));
  }
}

// write_cache_rows into a q8_0 cache: each row's `heads` keys and values (S, head_dim
// each, `key_ld` / `value_ld` apart) quantized into their slot (cache [2, blocks,
// block_size, heads, q8_0_row_bytes(head_dim)] uint8 contiguous); negative slots skipped.
template <typename S>
void write_q8_0_cache_rows(uint8_t* cache, int64_t slots, const S* keys, int64_t key_ld,
                           const S* values, int64_t value_ld, int64_t rows, int64_t heads,
                           int64_t head_dim, const int64_t* slot_of) {
  const int64_t width = heads * head_dim, slot_bytes = heads * q8_0_row_bytes(head_dim);
  uint8_t* key_cache = cache;
  uint8_t* value_cache = cache + slots * slot_bytes;
  parallel_for(rows, grain(8 * width), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(width);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t slot = slot_of[r];
      if (slot < 0) continue;
      for (const auto& [src, dst] : {std::make_pair(keys + r * key_ld, key_cache),
                                     std::make_pair(values + r * value_ld, value_cache)}) {
        const float* x = float_row(src, buffer.data(), width);
        for (int64_t h = 0; h < heads; ++h) {
          quantize_q8_0(dst + slot * slot_bytes + h * q8_0_row_bytes(head_dim),
                        x + h * head_dim, head_dim);
        }
      }
    }
  });
}

}  // namespace pagestream
