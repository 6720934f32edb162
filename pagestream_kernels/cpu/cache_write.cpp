// This step's keys and values into their cache slots for the torch modules (the C++ form of
// pagestream_kernels.reference.reshape_and_cache): argument checks, then the row kernel.
//
// key, value  [tokens, num_kv_heads, head_dim], rows any stride apart (slices of QKV)
// kv_cache    [2, num_blocks, block_size, num_kv_heads, head_dim] contiguous, or uint8 q8_0
//             rows [.., num_kv_heads, q8_0_row_bytes(head_dim)] (q8_0.h) quantized here
// slots       [tokens]: block * block_size + offset; negative: not written
#include <torch/extension.h>

#include "q8_0.h"
#include "row_kernels.h"

void cache_write(torch::Tensor key, torch::Tensor value, torch::Tensor cache,
                 torch::Tensor slot_mapping) {
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5 && cache.size(0) == 2,
              "cache_write: kv_cache must be a contiguous [2, blocks, block_size, heads, dim]");
  const bool q8 = cache.scalar_type() == at::kByte;
  const int64_t head_dim = key.size(2);
  const int64_t row = q8 ? pagestream::q8_0_row_bytes(head_dim) : head_dim;
  TORCH_CHECK(!q8 || head_dim % pagestream::Q8_GROUP == 0,
              "cache_write: a q8_0 cache needs a head_dim that is a multiple of 32, not ",
              head_dim);
  for (const auto& t : {key, value}) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.stride(2) == 1 &&
                    t.stride(1) == t.size(2) && t.size(1) == cache.size(3) &&
                    t.size(2) == head_dim && row == cache.size(4) &&
                    t.scalar_type() == key.scalar_type(),
                "cache_write: key/value must be [tokens, heads, dim] rows of the cache's shape");
  }
  TORCH_CHECK(value.size(0) == key.size(0) && slot_mapping.numel() == key.size(0),
              "cache_write: one slot per token");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t num_slots = cache.size(1) * cache.size(2);
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK(s[t] < num_slots, "cache_write: slot ", s[t], " is out of range [0, ",
                num_slots, ")");
  }
  const auto src = key.scalar_type(), dst = cache.scalar_type();
  if (q8) {
    pagestream::with_type(src, "cache_write", [&](auto sv) {
      using S = decltype(sv);
      pagestream::write_q8_0_cache_rows(cache.data_ptr<uint8_t>(), num_slots, key.data_ptr<S>(),
                                        key.stride(0), value.data_ptr<S>(), value.stride(0),
                                        key.size(0), key.size(1), head_dim, s);
    });
    return;
  }
  TORCH_CHECK(src == dst || (src == at::kFloat && dst == at::kBFloat16), "cache_write: ", src,
              " rows into a ", dst, " cache are not supported");
  const int64_t width = key.size(1) * key.size(2);
  pagestream::with_type(src, "cache_write", [&](auto sv) {
    using S = decltype(sv);
    pagestream::with_type(dst, "cache_write", [&](auto cv) {
      using C = decltype(cv);
      pagestream::write_cache_rows(cache.data_ptr<C>(), num_slots, key.data_ptr<S>(),
                                   key.stride(0), value.data_ptr<S>(), value.stride(0),
                                   key.size(0), width, s);
    });
  });
}
