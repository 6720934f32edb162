// Paged attention over any step's rows, for the native CPU step (paged_decode.cpp).
#pragma once

#include <torch/extension.h>

namespace pagestream {

// out, query [num_rows, num_q_heads, head_dim] float32; kv_cache [2, blocks, block_size,
// kv_heads, head_dim] float32 or bfloat16, or uint8 q8_0 rows [.., kv_heads,
// q8_0_row_bytes(head_dim)] (q8_0.h); row r attends to the first row_len[r] cached
// positions of sequence row_seq[r] (block_table [num_seqs, max_blocks]): its causal prefix,
// row_len[r] = its position + 1. row_limit, when not null, lets row r see keys up to
// row_limit[r] >= row_len[r] (an image token of a bidirectional image: its image's last
// position + 1); a sliding window still starts from row_len[r].
void attend_rows(float* out, const float* query, int64_t num_q_heads, const at::Tensor& kv_cache,
                 const int32_t* block_table, int64_t num_seqs, int64_t max_blocks,
                 const int32_t* row_seq, const int32_t* row_len, const int32_t* row_limit,
                 int64_t num_rows, float scale, int64_t sliding_window, float soft_cap);

}  // namespace pagestream
