// The Python module of the CPU extension: every entry point of pagestream_kernels/cpu's sources.
#include <torch/extension.h>

#include <tuple>
#include <vector>

void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                  torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                  double scale, int64_t sliding_window, double soft_cap);  // paged_decode.cpp
void paged_attention_rows(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                          torch::Tensor block_table, torch::Tensor row_seq,
                          torch::Tensor row_len, double scale, int64_t sliding_window,
                          double soft_cap, c10::optional<torch::Tensor> row_limit);  // paged_decode.cpp
int64_t pin_threads(const std::vector<int64_t>& cpus);  // pin_threads.cpp
void cache_write(torch::Tensor key, torch::Tensor value, torch::Tensor cache,
                 torch::Tensor slot_mapping);  // cache_write.cpp
void add_rms_norm(torch::Tensor out, torch::Tensor sum_out, torch::Tensor residual,
                  torch::Tensor x, torch::Tensor weight, double eps);  // fused.cpp
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up);        // fused.cpp
void rotary(torch::Tensor out, torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
            int64_t head_dim);  // fused.cpp
namespace pagestream {
void bind_native_step(pybind11::module_& m);  // decoder_stack.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_q4_k(const at::Tensor& raw);  // gguf_decode.cpp
std::tuple<at::Tensor, at::Tensor> decode_q6_k(const at::Tensor& raw);  // gguf_decode.cpp
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "decode attention over the paged KV cache (float32 / bfloat16)");
  m.def("paged_attention_rows", &paged_attention_rows,
        "attention of any step's rows (each over its causal prefix, or up to its key limit) "
        "over the paged KV cache",
        pybind11::arg("out"), pybind11::arg("query"), pybind11::arg("kv_cache"),
        pybind11::arg("block_table"), pybind11::arg("row_seq"), pybind11::arg("row_len"),
        pybind11::arg("scale"), pybind11::arg("sliding_window"), pybind11::arg("soft_cap"),
        pybind11::arg("row_limit") = pybind11::none());
  m.def("cache_write", &cache_write, "this step's keys and values into their cache slots");
  m.def("pin_threads", &pin_threads, "pin intra-op thread i to cpus[i]; returns how many");
  m.def("add_rms_norm", &add_rms_norm, "out = rms_norm(residual + x), sum_out = residual + x");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up for [gate | up]");
  m.def("rotary", &rotary, "rotary embedding of [tokens, heads * head_dim] (HF rotate_half)");
  m.def("decode_q4_k", &pagestream::decode_q4_k,
        "GGUF Q4_K blocks [N, bytes] -> 4-bit codes, float32 scales and mins (exact)");
  m.def("decode_q6_k", &pagestream::decode_q6_k,
        "GGUF Q6_K blocks [N, bytes] -> int8 codes and float32 scales (exact)");
  pagestream::bind_native_step(m);
}
