// GGUF's K-quant blocks decoded into QuantizedWeight's form, row by row over the thread
// team: the same values, bit for bit, as services/worker/layers/quantization/gguf_blocks.py
// (the numpy decoders, which stay the reference and the path without this extension).
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <tuple>

#include "thread_pool.h"

namespace pagestream {
namespace {

inline float f16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

at::Tensor checked_raw(const at::Tensor& raw, int64_t block_bytes, const char* name) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.device().is_cpu(),
              name, ": raw blocks must be uint8 [N, bytes per row] on the CPU");
  TORCH_CHECK(raw.size(1) % block_bytes == 0, name, ": a row of ", raw.size(1),
              " bytes is not whole blocks of ", block_bytes);
  return raw.contiguous();
}

void q4_k_block(const uint8_t* b, uint8_t* codes, float* scales, float* mins) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t* p = b + 4;  // sc_lo [0, 4), mn_lo [4, 8), rest [8, 12)
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? p[j] & 63 : (p[j + 4] & 15) | ((p[j - 4] >> 6) << 4);
    const int mn = j < 4 ? p[j + 4] & 63 : (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
    scales[j] = d * static_cast<float>(sc);
    mins[j] = -(dmin * static_cast<float>(mn));
  }
  for (int c = 0; c < 4; ++c) {
    const uint8_t* q = b + 16 + 32 * c;
    uint8_t* out = codes + 32 * c;
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<uint8_t>((q[2 * j] & 15) | ((q[2 * j + 1] & 15) << 4));
      out[16 + j] = static_cast<uint8_t>((q[2 * j] >> 4) | (q[2 * j + 1] & 0xF0));
    }
  }
}

void q6_k_block(const uint8_t* b, int8_t* codes, float* scales) {
  const float d = f16_at(b + 208);
  for (int g = 0; g < 16; ++g) scales[g] = d * static_cast<float>(static_cast<int8_t>(b[192 + g]));
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    for (int pair = 0; pair < 4; ++pair) {
      for (int l = 0; l < 32; ++l) {
        const int r = 32 * pair + l;  // element of this half
        const int low = r < 64 ? ql[r] & 15 : ql[r - 64] >> 4;
        const int high = (qh[l] >> (2 * pair)) & 3;
        codes[128 * h + r] = static_cast<int8_t>((low | (high << 4)) - 32);
      }
    }
  }
}

}  // namespace

// Q4_K  256 elements, 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and
//       mins, 128 bytes of nibbles (chunk c of 32 bytes: sub-block 2c in the low
//       nibbles, 2c + 1 in the high ones)
//       -> codes uint8 [N, K / 2] (byte j: element 2j low, 2j + 1 high), float32 scales
//          d * sc_j and mins -(dmin * m_j), [N, K / 32]
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_q4_k(const at::Tensor& raw_blocks) {
  const at::Tensor raw = checked_raw(raw_blocks, 144, "decode_q4_k");
  const int64_t n = raw.size(0), nb = raw.size(1) / 144;
  auto codes = at::empty({n, nb * 128}, at::kByte);
  auto scales = at::empty({n, nb * 8}, at::kFloat), mins = at::empty({n, nb * 8}, at::kFloat);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* c = codes.data_ptr<uint8_t>();
  float *s = scales.data_ptr<float>(), *m = mins.data_ptr<float>();
  pagestream::parallel_for(n * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) q4_k_block(src + i * 144, c + i * 128, s + i * 8, m + i * 8);
  });
  return {codes, scales, mins};
}

// Q6_K  256 elements, 210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d
//       -> codes int8 [N, K] (q - 32), float32 scales d * sc [N, K / 16]
std::tuple<at::Tensor, at::Tensor> decode_q6_k(const at::Tensor& raw_blocks) {
  const at::Tensor raw = checked_raw(raw_blocks, 210, "decode_q6_k");
  const int64_t n = raw.size(0), nb = raw.size(1) / 210;
  auto codes = at::empty({n, nb * 256}, at::kChar);
  auto scales = at::empty({n, nb * 16}, at::kFloat);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  int8_t* c = codes.data_ptr<int8_t>();
  float* s = scales.data_ptr<float>();
  pagestream::parallel_for(n * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) q6_k_block(src + i * 210, c + i * 256, s + i * 16);
  });
  return {codes, scales};
}

}  // namespace pagestream
