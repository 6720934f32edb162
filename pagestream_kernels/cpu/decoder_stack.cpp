// The native CPU step: a Llama-family decoder stack (one pipeline stage of it) run over one
// step's flattened rows in a single call from Python, as a schedule over the row kernels
// (row_kernels.h), the linears (linear.h, LoRA: lora.h) and paged attention. The residual
// stream, norms, rotary and attention are float32; each matmul input is rounded once into
// its weight's input type and every matmul writes float32, so bfloat16 weights cost no extra
// rounding of the residual. Rows carry their own causal length (speculative verification
// needs nothing new); tensor-parallel row outputs go through `all_reduce` before the residual
// add. Buffers grow to the largest step seen and are reused.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "linear.h"
#include "lora.h"
#include "moe_block.h"
#include "packed_linear.h"
#include "paged_attention.h"
#include "q8_0.h"
#include "part_clock.h"
#include "row_kernels.h"
#include "thread_pool.h"

namespace pagestream {
namespace {

namespace py = pybind11;

enum LinearIndex { QKV_LINEAR, O_LINEAR, GATE_UP_LINEAR, DOWN_LINEAR, NUM_LINEARS };
constexpr const char* LINEAR_NAMES[NUM_LINEARS] = {"qkv", "o", "gate_up", "down"};

struct Layer {
  std::shared_ptr<Linear> qkv, o, gate_up, down;
  std::vector<float> input_norm, post_norm;
  int64_t sliding_window;
  // query / key norms: per head [head_dim] (Qwen3), or over all of them [H * D], [K * D]
  // (OLMoE), or empty
  std::vector<float> q_norm, k_norm;
  float clip_qkv = 0.f;  // q, k (after their norms) and v clamped to +-clip_qkv; 0: none
  std::vector<float> attn_out_norm, mlp_out_norm;  // Gemma's norms of the blocks' outputs
  int64_t rotary = 0;  // the step's rotary table this layer uses; -1: none
  int64_t kv_group = 0;  // the KV cache group whose block table and slots it uses
  LinearLoRA lora[NUM_LINEARS];  // adapter slices bound to each linear (empty: none)
  std::shared_ptr<MoEBlock> moe;  // a mixture of experts instead of gate_up / down

  const Linear& linear(int index) const {
    const std::shared_ptr<Linear>* all[NUM_LINEARS] = {&qkv, &o, &gate_up, &down};
    return **all[index];
  }
};

}  // namespace

// The stack's shape: one pipeline stage's layers, this tensor-parallel rank's share of them
// (services/worker/native_step.py fills it from the model's description).
// attention_scale: the softmax scale (0: 1 / sqrt(head_dim)); activation of the gated MLP:
// "silu" or "gelu_pytorch_tanh".
struct StackConfig {
  int64_t hidden = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, intermediate = 0;
  double eps = 1e-6, attention_scale = 0.0;
  std::string activation = "silu";
};

// One layer's linears (any weight format, packed by the caller), norm weights, window
// (0: full attention), for Qwen3 and Gemma 3 the per-head query and key norms [head_dim],
// for Gemma the norms of the attention's and the MLP's outputs [hidden] (unset: none), and
// the index of its rotary table in the step's cos/sin (-1: no rotary), and its KV cache
// group (the step's block_table / slot_mapping row it reads when there are several).
struct LayerWeights {
  PackedLinear qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm;
  int64_t sliding_window = 0;
  at::Tensor q_norm, k_norm, attn_out_norm, mlp_out_norm;
  int64_t rotary = 0;
  double clip_qkv = 0.0;  // OLMoE: q, k and v clamped to +-clip_qkv (0: none)
  int64_t kv_group = 0;
  MoEWeights moe;  // its router set: the layer's MLP is this mixture (gate_up / down unset)
};

// One step's inputs. hidden [T, hidden] float32, updated in place through every layer (then
// normed into `out` [T, hidden] when the stack has a final norm and out is given).
// cos/sin [tables, T, rot] (or [T, rot]: one table); kv_caches one per layer; slot_mapping [T] int64; block_table
// [S, max_blocks] (or, with KV cache groups, [G, T] and [G, S, max_blocks]: layer i uses
// group kv_group's), query_start_loc [S + 1], seq_lens [S] int32. all_reduce: None or a
// callable summing a [T, hidden] float32 tensor over the tensor-parallel group in place.
// layer_outputs: unset or [layers, T, hidden] float32, filled with each layer's output.
// lora_slots [T] / lora_ranks [slots] int32: each row's adapter slot (unset: none).
// key_limits: unset (causal) or [T] int32, the keys each row sees (its position + 1, or
// more for a bidirectional image's tokens; never past its sequence's length).
struct StepArgs {
  at::Tensor hidden, cos, sin;
  std::vector<at::Tensor> kv_caches;
  at::Tensor slot_mapping, block_table, query_start_loc, seq_lens, key_limits;
  py::object all_reduce = py::none();
  at::Tensor layer_outputs, out, lora_slots, lora_ranks;
};

class DecoderStack {
 public:
  DecoderStack(const StackConfig& config, const at::Tensor& final_norm)
      : hidden_(config.hidden),
        num_heads_(config.num_heads),
        num_kv_heads_(config.num_kv_heads),
        head_dim_(config.head_dim),
        intermediate_(config.intermediate),
        eps_(static_cast<float>(config.eps)),
        scale_(config.attention_scale > 0
                   ? static_cast<float>(config.attention_scale)
                   : static_cast<float>(1.0 / std::sqrt(static_cast<double>(config.head_dim)))),
        gelu_(config.activation == "gelu_pytorch_tanh"),
        final_norm_(final_norm.defined() && final_norm.numel() ? to_floats(final_norm)
                                                              : std::vector<float>{}) {
    TORCH_CHECK(hidden_ > 0 && num_heads_ > 0 && num_kv_heads_ > 0 && head_dim_ > 0 &&
                    intermediate_ > 0,
                "DecoderStack: every size of the StackConfig must be set (> 0)");
    TORCH_CHECK(gelu_ || config.activation == "silu",
                "DecoderStack: activation must be silu or gelu_pytorch_tanh, not ",
                config.activation);
  }

  void add_layer(const LayerWeights& w) {
    const bool moe = w.moe.router.defined() && w.moe.router.numel();
    TORCH_CHECK(w.qkv.linear() && w.o.linear() && (moe || (w.gate_up.linear() && w.down.linear())) &&
                    w.input_norm.defined() && w.post_norm.defined(),
                "DecoderStack.add_layer: qkv, o, gate_up and down (or a mixture of experts), "
                "input_norm and post_norm must all be set");
    TORCH_CHECK(!moe || !gelu_, "DecoderStack.add_layer: a mixture of experts runs SiLU experts");
    add_layer(w.qkv, w.o, moe ? PackedLinear() : w.gate_up, moe ? PackedLinear() : w.down,
              w.input_norm, w.post_norm, w.sliding_window);
    if (moe) layers_.back().moe = std::make_shared<MoEBlock>(w.moe, hidden_);
    const bool q = w.q_norm.defined() && w.q_norm.numel(), k = w.k_norm.defined() && w.k_norm.numel();
    const bool per_head = q && w.q_norm.numel() == head_dim_ && w.k_norm.numel() == head_dim_;
    const bool whole = q && w.q_norm.numel() == num_heads_ * head_dim_ &&
                       w.k_norm.numel() == num_kv_heads_ * head_dim_;
    TORCH_CHECK(q == k && (!q || per_head || whole),
                "DecoderStack.add_layer: q_norm and k_norm come together, [head_dim] each or "
                "[heads * head_dim] and [kv_heads * head_dim]");
    if (q) layers_.back().q_norm = to_floats(w.q_norm), layers_.back().k_norm = to_floats(w.k_norm);
    TORCH_CHECK(w.clip_qkv >= 0, "DecoderStack.add_layer: clip_qkv must be >= 0");
    layers_.back().clip_qkv = static_cast<float>(w.clip_qkv);
    const bool a = w.attn_out_norm.defined() && w.attn_out_norm.numel();
    const bool m = w.mlp_out_norm.defined() && w.mlp_out_norm.numel();
    TORCH_CHECK(a == m && (!a || (w.attn_out_norm.numel() == hidden_ && w.mlp_out_norm.numel() == hidden_)),
                "DecoderStack.add_layer: attn_out_norm and mlp_out_norm come together, [hidden] each");
    if (a) {
      layers_.back().attn_out_norm = to_floats(w.attn_out_norm);
      layers_.back().mlp_out_norm = to_floats(w.mlp_out_norm);
    }
    TORCH_CHECK(w.rotary >= -1, "DecoderStack.add_layer: rotary is a table index or -1");
    layers_.back().rotary = w.rotary;
    TORCH_CHECK(w.kv_group >= 0, "DecoderStack.add_layer: kv_group must be >= 0");
    layers_.back().kv_group = w.kv_group;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  void forward(const StepArgs& a) {
    StepScope step;  // the team's workers wait spinning between the step's parts
    TORCH_CHECK(a.hidden.defined() && a.cos.defined() && a.sin.defined() &&
                    a.slot_mapping.defined() && a.block_table.defined() &&
                    a.query_start_loc.defined() && a.seq_lens.defined(),
                "DecoderStack.forward: StepArgs needs hidden, cos, sin, slot_mapping, "
                "block_table, query_start_loc and seq_lens");
    forward(a.hidden, a.cos, a.sin, a.kv_caches, a.slot_mapping, a.block_table,
            a.query_start_loc, a.seq_lens, a.key_limits, a.all_reduce, a.layer_outputs, a.out,
            a.lora_slots, a.lora_ranks);
  }

 private:
  void add_layer(const PackedLinear& qkv, const PackedLinear& o, const PackedLinear& gate_up,
                 const PackedLinear& down, const at::Tensor& input_norm,
                 const at::Tensor& post_norm, int64_t sliding_window) {
    const int64_t qkv_width = (num_heads_ + 2 * num_kv_heads_) * head_dim_;
    const bool dense = gate_up.linear() != nullptr;
    TORCH_CHECK(qkv.out_features() == qkv_width && qkv.in_features() == hidden_ &&
                    o.out_features() == hidden_ && o.in_features() == num_heads_ * head_dim_ &&
                    (!dense || (gate_up.out_features() == 2 * intermediate_ &&
                                gate_up.in_features() == hidden_ && down.out_features() == hidden_ &&
                                down.in_features() == intermediate_)) &&
                    input_norm.numel() == hidden_ && post_norm.numel() == hidden_,
                "DecoderStack.add_layer: weight shapes do not match the stack's config");
    layers_.push_back(Layer{qkv.linear(), o.linear(), gate_up.linear(), down.linear(),
                            to_floats(input_norm), to_floats(post_norm), sliding_window});
  }


 public:
  // LoRA slices of one linear of layer `layer` ("qkv", "o", "gate_up" or "down"): slice i
  // adds B_i (A_i x) into output columns [offsets[i], offsets[i] + n_i) (lora.h). The
  // tensors are held; `load_lora_slot` copies a slot after Python wrote it.
  void set_lora(int64_t layer, const std::string& name, const std::vector<at::Tensor>& a,
                const std::vector<at::Tensor>& b, const std::vector<int64_t>& offsets) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "DecoderStack.set_lora: layer ", layer,
                " of ", num_layers());
    const auto* found = std::find(LINEAR_NAMES, LINEAR_NAMES + NUM_LINEARS, name);
    TORCH_CHECK(found != LINEAR_NAMES + NUM_LINEARS, "DecoderStack.set_lora: no linear ", name,
                " (qkv, o, gate_up, down)");
    TORCH_CHECK(a.size() == b.size() && a.size() == offsets.size(),
                "DecoderStack.set_lora: one A, B and offset per slice");
    const int index = static_cast<int>(found - LINEAR_NAMES);
    Layer& target = layers_[layer];
    const Linear& linear = target.linear(index);
    LinearLoRA slices;
    for (size_t i = 0; i < a.size(); ++i) {
      slices.emplace_back(a[i], b[i], offsets[i], linear.in_features(), linear.out_features(),
                          linear.input_type());
      TORCH_CHECK(slices.back().slots == slices.front().slots,
                  "DecoderStack.set_lora: every slice has the same slots");
    }
    target.lora[index] = std::move(slices);
  }

  // Copies adapter slot `slot` of every bound slice from its tensors (after Python loaded
  // an adapter into them).
  void load_lora_slot(int64_t slot) {
    for (auto& layer : layers_) {
      for (auto& slices : layer.lora) {
        for (auto& slice : slices) {
          TORCH_CHECK(slot >= 0 && slot < slice.slots, "DecoderStack.load_lora_slot: slot ",
                      slot, " of ", slice.slots);
          slice.load_slot(slot);
        }
      }
    }
  }

  // Bytes of every packed weight of the stack (the norms' float32 included).
  int64_t weight_bytes() const {
    int64_t bytes = 0;
    for (const auto& layer : layers_) {
      for (const auto* linear : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) {
        if (*linear != nullptr) bytes += (*linear)->weight_bytes();
      }
      if (layer.moe != nullptr) bytes += layer.moe->weight_bytes();
      bytes += static_cast<int64_t>((layer.input_norm.size() + layer.post_norm.size() +
                                     layer.q_norm.size() + layer.k_norm.size() +
                                     layer.attn_out_norm.size() + layer.mlp_out_norm.size()) *
                                    4);
    }
    return bytes;
  }

  // Turns the per-part clock on or off (and zeroes it); `profile()` reads it.
  void set_profiling(bool on) { clock_ = PartClock{}, clock_.on = on; }
  std::map<std::string, double> profile() const {
    std::map<std::string, double> parts;
    for (int p = 0; p < NUM_PARTS; ++p) parts[PART_NAMES[p]] = clock_.seconds[p];
    return parts;
  }

 private:
  // StepArgs' fields, one by one.
  void forward(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
               const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
               const at::Tensor& block_table, const at::Tensor& query_start_loc,
               const at::Tensor& seq_lens, const at::Tensor& key_limits,
               const py::object& all_reduce,
               at::Tensor layer_outputs, at::Tensor out, const at::Tensor& lora_slots,
               const at::Tensor& lora_ranks) {
    const int64_t rows = hidden.size(0);
    check_step(hidden, cos, sin, kv_caches, slot_mapping, block_table, query_start_loc, seq_lens);
    plan_rows(query_start_loc, seq_lens, rows);
    plan_limits(key_limits, seq_lens, rows);
    lora_rows_.plan(lora_slots, lora_ranks, rows);
    reserve(rows);
    float* x = hidden.data_ptr<float>();
    const bool reduce = !all_reduce.is_none();
    const bool grouped = block_table.dim() == 3;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const int64_t g = grouped ? layers_[i].kv_group : 0;
      attention_block(layers_[i], x, rows, cos, sin, kv_caches[i],
                      grouped ? slot_mapping[g] : slot_mapping,
                      grouped ? block_table[g] : block_table, reduce ? &all_reduce : nullptr);
      mlp_block(layers_[i], x, rows, reduce ? &all_reduce : nullptr);
      if (layer_outputs.defined() && layer_outputs.numel()) {
        std::memcpy(layer_outputs[i].data_ptr<float>(), x, rows * hidden_ * 4);
      }
    }
    if (!final_norm_.empty() && out.defined() && out.numel()) {
      TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat &&
                      out.numel() == rows * hidden_,
                  "DecoderStack.forward: out must be a contiguous float32 [T, hidden]");
      norm_rows<float>(out.data_ptr<float>(), x, rows, hidden_, final_norm_.data(), eps_);
    }
  }

  void check_step(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                  const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                  const at::Tensor& block_table, const at::Tensor& query_start_loc,
                  const at::Tensor& seq_lens) const {
    const int64_t rows = hidden.size(0);
    TORCH_CHECK(hidden.is_contiguous() && hidden.scalar_type() == at::kFloat &&
                    hidden.dim() == 2 && hidden.size(1) == hidden_,
                "DecoderStack.forward: hidden must be a contiguous float32 [T, ", hidden_, "]");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                    sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
                    (cos.dim() == 2 || cos.dim() == 3) && cos.size(-2) == rows &&
                    cos.size(-1) <= head_dim_,
                "DecoderStack.forward: cos/sin must be contiguous float32 [tables, T, rotary_dim]");
    const int64_t tables = cos.dim() == 3 ? cos.size(0) : 1;
    for (const auto& layer : layers_) {
      TORCH_CHECK(layer.rotary < tables, "DecoderStack.forward: a layer uses rotary table ",
                  layer.rotary, " of ", tables);
    }
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers(),
                "DecoderStack.forward: one KV cache per layer");
    for (const auto& cache : kv_caches) {
      if (cache.numel() == 0) continue;  // a memory-profiling run: attention is skipped
      const int64_t row = cache.scalar_type() == at::kByte ? q8_0_row_bytes(head_dim_) : head_dim_;
      TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5 && cache.size(3) == num_kv_heads_ &&
                      cache.size(4) == row &&
                      (cache.scalar_type() != at::kByte || head_dim_ % Q8_GROUP == 0),
                  "DecoderStack.forward: caches must be contiguous [2, blocks, block_size, ",
                  num_kv_heads_, ", ", row, "] (", head_dim_, " values, or their q8_0 row)");
    }
    const bool grouped = block_table.dim() == 3;
    const int64_t groups = grouped ? block_table.size(0) : 1;
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.dim() == (grouped ? 2 : 1) && slot_mapping.numel() == groups * rows,
                "DecoderStack.forward: slot_mapping must be int64 [T] (or [G, T] beside a "
                "block_table [G, S, n])");
    for (const auto& layer : layers_) {
      TORCH_CHECK(!grouped || layer.kv_group < groups, "DecoderStack.forward: a layer reads KV "
                  "cache group ", layer.kv_group, " of ", groups);
    }
    for (const auto& t : {block_table, query_start_loc, seq_lens}) {
      TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(),
                  "DecoderStack.forward: block_table, query_start_loc, seq_lens must be int32");
    }
    const int64_t seqs = seq_lens.numel();
    TORCH_CHECK(query_start_loc.numel() == seqs + 1 && (block_table.dim() == 2 || grouped) &&
                    block_table.size(-2) == seqs,
                "DecoderStack.forward: query_start_loc [S + 1] and block_table [S, n] or [G, S, n]");
    if (!kv_caches.empty() && kv_caches[0].numel() > 0) {
      const int64_t slots = kv_caches[0].size(1) * kv_caches[0].size(2);
      const int64_t* s = slot_mapping.data_ptr<int64_t>();
      for (int64_t r = 0; r < groups * rows; ++r) {
        TORCH_CHECK(s[r] < slots, "DecoderStack.forward: slot ", s[r], " is out of range");
      }
    }
  }

  // Each row's sequence and causal length: row t of a sequence with q query rows ending at
  // seq_len sees seq_len - q + 1 + (t - start) positions.
  void plan_rows(const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t rows) {
    const int32_t* starts = query_start_loc.data_ptr<int32_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const int64_t seqs = seq_lens.numel();
    TORCH_CHECK(starts[0] == 0 && starts[seqs] == rows,
                "DecoderStack.forward: query_start_loc must run from 0 to the step's rows");
    row_seq_.resize(rows);
    row_len_.resize(rows);
    for (int64_t s = 0; s < seqs; ++s) {
      const int64_t q = starts[s + 1] - starts[s];
      TORCH_CHECK(q >= 0 && q <= lens[s], "DecoderStack.forward: sequence ", s, " schedules ",
                  q, " rows but has length ", lens[s]);
      for (int64_t t = starts[s]; t < starts[s + 1]; ++t) {
        row_seq_[t] = static_cast<int32_t>(s);
        row_len_[t] = static_cast<int32_t>(lens[s] - q + 1 + (t - starts[s]));
      }
    }
  }

  // Each row's key limit (row_limit_ empty: causal), between its causal length and its
  // sequence's length (a row never reads a key this step has not written).
  void plan_limits(const at::Tensor& key_limits, const at::Tensor& seq_lens, int64_t rows) {
    row_limit_.clear();
    if (!key_limits.defined() || key_limits.numel() == 0) return;
    TORCH_CHECK(key_limits.scalar_type() == at::kInt && key_limits.is_contiguous() &&
                    key_limits.numel() == rows,
                "DecoderStack.forward: key_limits must be contiguous int32 [T]");
    const int32_t* limits = key_limits.data_ptr<int32_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    for (int64_t t = 0; t < rows; ++t) {
      TORCH_CHECK(row_len_[t] <= limits[t] && limits[t] <= lens[row_seq_[t]],
                  "DecoderStack.forward: row ", t, " has key limit ", limits[t],
                  ", outside its causal length ", row_len_[t], " .. its sequence's length ",
                  lens[row_seq_[t]]);
    }
    row_limit_.assign(limits, limits + rows);
  }

  void reserve(int64_t rows) {
    if (rows <= capacity_) return;
    int64_t cap = 16;
    while (cap < rows) cap *= 2;
    capacity_ = cap;
    const int64_t qkv = (num_heads_ + 2 * num_kv_heads_) * head_dim_;
    qkv_.assign(cap * qkv, 0.f);
    query_.assign(cap * num_heads_ * head_dim_, 0.f);
    attn_.assign(cap * num_heads_ * head_dim_, 0.f);
    gate_up_.assign(cap * 2 * intermediate_, 0.f);
    partial_.assign(cap * hidden_, 0.f);
    const int64_t widest = std::max({hidden_, intermediate_, num_heads_ * head_dim_});
    act_.assign(cap * widest * 4, 0);  // room for float32 rows of the widest input
  }

  // The input of `linear` in its type: rows of float32 `src` rounded once (normed first
  // when `norm` is given).
  void* matmul_input(const Linear& linear, const float* src, int64_t rows, int64_t width,
                     const float* norm) {
    with_type(linear.input_type(), "native step", [&](auto tv) {
      using T = decltype(tv);
      T* dst = static_cast<T*>(act());
      if (norm != nullptr) {
        norm_rows<float>(dst, src, rows, width, norm, eps_);
      } else {
        round_rows(dst, src, rows, width);
      }
    });
    return act();
  }

  // out += the adapters' B (A input) for this step's rows with one (input: `linear`'s).
  void add_lora_rows(const LinearLoRA& lora, const Linear& linear, const void* input,
                     float* out, int64_t ld) const {
    if (lora.empty() || lora_rows_.empty()) return;
    with_type(linear.input_type(), "native step", [&](auto tv) {
      using T = decltype(tv);
      add_lora(lora, lora_rows_, static_cast<const T*>(input), linear.in_features(), out, ld);
    });
  }

  // x += linear(input) (+ its LoRA adds), normed by `out_norm` when it is given (Gemma):
  // straight into the residual, or through all_reduce (and the norm) first.
  void add_row_parallel(const Linear& linear, const LinearLoRA& lora, const void* input,
                        float* x, int64_t rows, const py::object* all_reduce,
                        const std::vector<float>& out_norm) {
    const int64_t k = linear.in_features();
    if (all_reduce == nullptr && out_norm.empty()) {
      linear.run(input, rows, k, x, hidden_, true);
      add_lora_rows(lora, linear, input, x, hidden_);
      return;
    }
    linear.run(input, rows, k, partial_.data(), hidden_, false);
    add_lora_rows(lora, linear, input, partial_.data(), hidden_);
    add_partial(x, rows, all_reduce, out_norm);
  }

  // x += partial_ [rows, hidden] (this rank's part of a row-parallel output), summed over
  // the ranks by all_reduce and normed by out_norm first where given.
  void add_partial(float* x, int64_t rows, const py::object* all_reduce,
                   const std::vector<float>& out_norm) {
    if (all_reduce != nullptr) {
      py::gil_scoped_acquire gil;
      (*all_reduce)(torch::from_blob(partial_.data(), {rows, hidden_}, at::kFloat));
    }
    if (!out_norm.empty()) {
      norm_rows<float>(partial_.data(), partial_.data(), rows, hidden_, out_norm.data(), eps_);
    }
    add_rows(x, partial_.data(), rows, hidden_);
  }

  void attention_block(const Layer& layer, float* x, int64_t rows, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping, const at::Tensor& block_table,
                       const py::object* all_reduce) {
    const int64_t q_width = num_heads_ * head_dim_, kv_width = num_kv_heads_ * head_dim_;
    const int64_t ld = q_width + 2 * kv_width, rot = layer.rotary < 0 ? 0 : cos.size(-1);
    clock_.start();
    const void* normed = matmul_input(*layer.qkv, x, rows, hidden_, layer.input_norm.data());
    layer.qkv->run(normed, rows, hidden_, qkv_.data(), ld, false);  // [T, (H + 2K) * D]
    add_lora_rows(layer.lora[QKV_LINEAR], *layer.qkv, normed, qkv_.data(), ld);
    if (!layer.q_norm.empty()) {
      // per head, or one norm over all of the queries' (keys') features
      const bool whole = static_cast<int64_t>(layer.q_norm.size()) == q_width && num_heads_ > 1;
      const int64_t q_heads = whole ? 1 : num_heads_, k_heads = whole ? 1 : num_kv_heads_;
      const int64_t q_dim = whole ? q_width : head_dim_, k_dim = whole ? kv_width : head_dim_;
      norm_heads(qkv_.data(), ld, rows, q_heads, q_dim, layer.q_norm.data(), eps_);
      norm_heads(qkv_.data() + q_width, ld, rows, k_heads, k_dim, layer.k_norm.data(), eps_);
    }
    if (layer.clip_qkv > 0.f) clamp_rows(qkv_.data(), rows * ld, layer.clip_qkv);
    clock_.stop(NORM_QKV);
    const int64_t table = std::max<int64_t>(layer.rotary, 0) * rows * cos.size(-1);
    const float* c = cos.data_ptr<float>() + table;
    const float* s = sin.data_ptr<float>() + table;
    float* keys = qkv_.data() + q_width;
    rotary_rows(query_.data(), q_width, qkv_.data(), ld, rows, num_heads_, head_dim_, c, s, rot);
    rotary_rows(keys, ld, keys, ld, rows, num_kv_heads_, head_dim_, c, s, rot);
    if (kv_cache.numel() == 0) {  // a memory-profiling run before the cache exists
      std::fill(attn_.begin(), attn_.begin() + rows * q_width, 0.f);
    } else {
      const int64_t slots = kv_cache.size(1) * kv_cache.size(2);
      if (kv_cache.scalar_type() == at::kByte) {  // q8_0 rows, quantized as they are written
        write_q8_0_cache_rows(kv_cache.data_ptr<uint8_t>(), slots, keys, ld, keys + kv_width, ld,
                              rows, num_kv_heads_, head_dim_, slot_mapping.data_ptr<int64_t>());
      } else {
        with_type(kv_cache.scalar_type(), "native step", [&](auto cv) {
          write_cache_rows(kv_cache.data_ptr<decltype(cv)>(), slots, keys, ld, keys + kv_width,
                           ld, rows, kv_width, slot_mapping.data_ptr<int64_t>());
        });
      }
      clock_.stop(ROTARY_CACHE);
      attend_rows(attn_.data(), query_.data(), num_heads_, kv_cache,
                  block_table.data_ptr<int32_t>(), block_table.size(0), block_table.size(1),
                  row_seq_.data(), row_len_.data(),
                  row_limit_.empty() ? nullptr : row_limit_.data(), rows, scale_,
                  layer.sliding_window, 0.f);
      clock_.stop(ATTENTION);
    }
    const void* mixed = matmul_input(*layer.o, attn_.data(), rows, q_width, nullptr);
    add_row_parallel(*layer.o, layer.lora[O_LINEAR], mixed, x, rows, all_reduce,
                     layer.attn_out_norm);
    clock_.stop(O_PROJ);
  }

  void mlp_block(const Layer& layer, float* x, int64_t rows, const py::object* all_reduce) {
    if (layer.moe != nullptr) {
      moe_normed_.resize(rows * hidden_);
      norm_rows<float>(moe_normed_.data(), x, rows, hidden_, layer.post_norm.data(), eps_);
      clock_.stop(NORM_GATE_UP);
      layer.moe->run(moe_normed_.data(), rows, partial_.data());
      add_partial(x, rows, all_reduce, layer.mlp_out_norm);
      clock_.stop(DOWN);
      return;
    }
    const void* normed = matmul_input(*layer.gate_up, x, rows, hidden_, layer.post_norm.data());
    layer.gate_up->run(normed, rows, hidden_, gate_up_.data(), 2 * intermediate_, false);
    add_lora_rows(layer.lora[GATE_UP_LINEAR], *layer.gate_up, normed, gate_up_.data(), 2 * intermediate_);
    clock_.stop(NORM_GATE_UP);
    with_type(layer.down->input_type(), "native step", [&](auto tv) {
      using T = decltype(tv);
      if (gelu_) {
        gelu_tanh_mul_rows(static_cast<T*>(act()), gate_up_.data(), rows, intermediate_);
      } else {
        silu_mul_rows<float>(static_cast<T*>(act()), gate_up_.data(), rows, intermediate_);
      }
    });
    clock_.stop(SILU);
    add_row_parallel(*layer.down, layer.lora[DOWN_LINEAR], act(), x, rows, all_reduce,
                     layer.mlp_out_norm);
    clock_.stop(DOWN);
  }

  int64_t hidden_, num_heads_, num_kv_heads_, head_dim_, intermediate_;
  float eps_, scale_;
  bool gelu_;
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  int64_t capacity_ = 0;
  std::vector<float> qkv_, query_, attn_, gate_up_, partial_, moe_normed_;
  std::vector<uint8_t> act_;  // the next matmul's input, in its weight's input type
  void* act() { return act_.data(); }
  std::vector<int32_t> row_seq_, row_len_, row_limit_;
  LoRARows lora_rows_;  // this step's rows with an adapter
  PartClock clock_;
};

void bind_native_step(py::module_& m) {
  py::class_<StackConfig>(m, "StackConfig")
      .def(py::init<>())
      .def_readwrite("hidden", &StackConfig::hidden)
      .def_readwrite("num_heads", &StackConfig::num_heads)
      .def_readwrite("num_kv_heads", &StackConfig::num_kv_heads)
      .def_readwrite("head_dim", &StackConfig::head_dim)
      .def_readwrite("intermediate", &StackConfig::intermediate)
      .def_readwrite("eps", &StackConfig::eps)
      .def_readwrite("attention_scale", &StackConfig::attention_scale)
      .def_readwrite("activation", &StackConfig::activation);
  py::class_<LayerWeights>(m, "LayerWeights")
      .def(py::init<>())
      .def_readwrite("qkv", &LayerWeights::qkv)
      .def_readwrite("o", &LayerWeights::o)
      .def_readwrite("gate_up", &LayerWeights::gate_up)
      .def_readwrite("down", &LayerWeights::down)
      .def_readwrite("input_norm", &LayerWeights::input_norm)
      .def_readwrite("post_norm", &LayerWeights::post_norm)
      .def_readwrite("sliding_window", &LayerWeights::sliding_window)
      .def_readwrite("q_norm", &LayerWeights::q_norm)
      .def_readwrite("k_norm", &LayerWeights::k_norm)
      .def_readwrite("attn_out_norm", &LayerWeights::attn_out_norm)
      .def_readwrite("mlp_out_norm", &LayerWeights::mlp_out_norm)
      .def_readwrite("rotary", &LayerWeights::rotary)
      .def_readwrite("clip_qkv", &LayerWeights::clip_qkv)
      .def_readwrite("kv_group", &LayerWeights::kv_group)
      .def_readwrite("moe", &LayerWeights::moe);
  py::class_<MoEWeights>(m, "MoEWeights")
      .def(py::init<>())
      .def_readwrite("router", &MoEWeights::router)
      .def_readwrite("gate_up", &MoEWeights::gate_up)
      .def_readwrite("down", &MoEWeights::down)
      .def_readwrite("top_k", &MoEWeights::top_k)
      .def_readwrite("renormalize", &MoEWeights::renormalize)
      .def_readwrite("shared_gate_up", &MoEWeights::shared_gate_up)
      .def_readwrite("shared_down", &MoEWeights::shared_down)
      .def_readwrite("shared_gate", &MoEWeights::shared_gate);
  py::class_<StepArgs>(m, "StepArgs")
      .def(py::init<>())
      .def_readwrite("hidden", &StepArgs::hidden)
      .def_readwrite("cos", &StepArgs::cos)
      .def_readwrite("sin", &StepArgs::sin)
      .def_readwrite("kv_caches", &StepArgs::kv_caches)
      .def_readwrite("slot_mapping", &StepArgs::slot_mapping)
      .def_readwrite("block_table", &StepArgs::block_table)
      .def_readwrite("query_start_loc", &StepArgs::query_start_loc)
      .def_readwrite("seq_lens", &StepArgs::seq_lens)
      .def_readwrite("key_limits", &StepArgs::key_limits)
      .def_readwrite("all_reduce", &StepArgs::all_reduce)
      .def_readwrite("layer_outputs", &StepArgs::layer_outputs)
      .def_readwrite("out", &StepArgs::out)
      .def_readwrite("lora_slots", &StepArgs::lora_slots)
      .def_readwrite("lora_ranks", &StepArgs::lora_ranks);
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<const StackConfig&, at::Tensor>())
      .def("add_layer", py::overload_cast<const LayerWeights&>(&DecoderStack::add_layer))
      .def("num_layers", &DecoderStack::num_layers)
      .def("set_lora", &DecoderStack::set_lora)
      .def("load_lora_slot", &DecoderStack::load_lora_slot)
      .def("weight_bytes", &DecoderStack::weight_bytes)
      .def("set_profiling", &DecoderStack::set_profiling)
      .def("profile", &DecoderStack::profile)
      .def("forward", py::overload_cast<const StepArgs&>(&DecoderStack::forward),
           py::arg("args"), py::call_guard<py::gil_scoped_release>());
  py::class_<PackedLinear>(m, "PackedLinear")
      .def(py::init<>(), "none (an expert another rank holds)")
      .def(py::init<at::Tensor, at::Tensor>())
      .def_static("quantized", &PackedLinear::quantized)
      .def_static("stacked", &PackedLinear::stacked)
      .def("forward", &PackedLinear::forward)
      .def("gather_rows", &PackedLinear::gather_rows)
      .def("in_features", &PackedLinear::in_features)
      .def("out_features", &PackedLinear::out_features)
      .def("weight_bytes", &PackedLinear::weight_bytes)
      .def("format", &PackedLinear::format);
  m.def("set_quantized_stream_rows", &set_quantized_stream_rows,
        "up to how many rows quantized linears of a bfloat16 model stream their codes (VNNI)");
  m.def("linear_supported", &linear_supported,
        "whether the packed-linear kernel for a dtype runs on this CPU");
}

}  // namespace pagestream
