// This step's keys and values into their cache slots (the C++ form of
// pagestream_kernels.reference.reshape_and_cache): one pass, no index tensors, rounding to the
// cache's dtype on the way (float32 -> bfloat16 rounds to nearest even, as torch's .to).
//
// key, value  [tokens, num_kv_heads, head_dim], rows any stride apart (slices of QKV)
// kv_cache    [2, num_blocks, block_size, num_kv_heads, head_dim] contiguous
// slots       [tokens] int64: block * block_size + offset; negative: not written
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <cstring>

namespace {

using bf16 = c10::BFloat16;

template <typename S, typename C>
inline void copy_row(C* dst, const S* src, int64_t n) {
  if constexpr (std::is_same_v<S, C>) {
    std::memcpy(dst, src, n * sizeof(C));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(static_cast<float>(src[i]));
  }
}

template <typename S, typename C>
void write(torch::Tensor key, torch::Tensor value, torch::Tensor cache, const int64_t* slots) {
  const int64_t tokens = key.size(0), row = key.size(1) * key.size(2);
  const int64_t num_slots = cache.size(1) * cache.size(2);
  C* keys = cache.data_ptr<C>();
  C* values = keys + num_slots * row;
  const S* k = key.data_ptr<S>();
  const S* v = value.data_ptr<S>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      copy_row(keys + slot * row, k + t * ks, row);
      copy_row(values + slot * row, v + t * vs, row);
    }
  });
}

}  // namespace

void cache_write(torch::Tensor key, torch::Tensor value, torch::Tensor cache,
                 torch::Tensor slot_mapping) {
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5 && cache.size(0) == 2,
              "cache_write: kv_cache must be a contiguous [2, blocks, block_size, heads, dim]");
  for (const auto& t : {key, value}) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.stride(2) == 1 &&
                    t.stride(1) == t.size(2) && t.size(1) == cache.size(3) &&
                    t.size(2) == cache.size(4) && t.scalar_type() == key.scalar_type(),
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
  if (src == at::kFloat && dst == at::kFloat) {
    write<float, float>(key, value, cache, s);
  } else if (src == at::kBFloat16 && dst == at::kBFloat16) {
    write<bf16, bf16>(key, value, cache, s);
  } else if (src == at::kFloat && dst == at::kBFloat16) {
    write<float, bf16>(key, value, cache, s);
  } else {
    TORCH_CHECK(false, "cache_write: ", src, " rows into a ", dst, " cache are not supported");
  }
}
