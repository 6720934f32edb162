"""Our models' logits equal HF transformers' (eager, float32) on tiny random checkpoints.

Each architecture runs (a) a whole prompt in one step, (b) the prompt in chunks across steps,
(c) decode steps, and (d) one batch mixing a prefill, a chunk over cached context (whose
prefix blocks come from an earlier request) and decode rows.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig

from services.common.config import ModelConfig
from services.worker.layers import attention
from services.worker.layers.attention import (
    TORCH_ATTENTION,
    AttentionOps,
    resolve_attention_backend,
)
from services.worker.layers.linear import MergedColumnLinear, QKVLinear, RowLinear
from services.worker.layers.rotary_embedding import RotaryEmbedding
from services.worker.model_loader import load_model
from services.worker.models.hf_fallback import HFFallbackForCausalLM
from services.worker.models.kv_cache_spec import KVCacheSpec
from services.worker.models.llama import (
    Gemma3ForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    SmolLM3ForCausalLM,
)
from services.worker.models.mixture_of_experts import (
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from tests.helpers.paged_session import SeqState
from tests.helpers.tiny_models import MOE_FAMILIES, VOCAB, random_tokens

ATOL = 1e-4
ARCHS = [
    *("llama", "llama_tied", "qwen2", "qwen2_sliding", "qwen3", "qwen3_bias", "mistral"),
    *("smollm3", "gemma3", "phi4", "gpt2", "opt"),
    *MOE_FAMILIES,
]
EXPECTED_CLASS = {
    "llama": LlamaForCausalLM,
    "llama_tied": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen2_sliding": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_bias": Qwen3ForCausalLM,
    "mistral": MistralForCausalLM,
    "smollm3": SmolLM3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "phi4": Phi3ForCausalLM,
    "gpt2": HFFallbackForCausalLM,
    "opt": HFFallbackForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "olmoe": OlmoeForCausalLM,
}


def load(folder):
    return load_model(ModelConfig(model=str(folder), dtype="float32"), device="cpu")


def assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_prompt_one_step(arch, tiny_model_dir, hf_logits, make_session):
    folder = tiny_model_dir(arch)
    model = load(folder)
    assert type(model) is EXPECTED_CLASS[arch]
    session = make_session(model)
    seq = SeqState(random_tokens(21, seed=1))
    (logits,) = session.step([(seq, 21)])
    assert_close(logits, hf_logits(folder, seq.token_ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_then_decode(arch, tiny_model_dir, hf_logits, make_session):
    folder = tiny_model_dir(arch)
    session = make_session(load(folder))
    seq = SeqState(random_tokens(23, seed=2))
    reference = hf_logits(folder, seq.token_ids)
    done = 0
    for chunk in (7, 5, 8):  # chunks that end mid-block and on a block boundary
        (logits,) = session.step([(seq, chunk)])
        assert_close(logits, reference[done : done + chunk])
        done += chunk
    for _ in range(3):  # decode rows over the cached context
        (logits,) = session.step([(seq, 1)])
        assert_close(logits, reference[done : done + 1])
        done += 1


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_with_prefix_reuse(arch, tiny_model_dir, hf_logits, make_session):
    folder = tiny_model_dir(arch)
    session = make_session(load(folder))
    block = session.block_size
    shared = random_tokens(3 * block, seed=3)
    earlier = SeqState(shared + random_tokens(5, seed=4))  # an earlier request
    decoding = SeqState(random_tokens(14, seed=5))
    session.step([(earlier, 3 * block + 2), (decoding, 11)])

    hit = session.fork_prefix(earlier, shared + random_tokens(9, seed=6), num_blocks=3)
    fresh = SeqState(random_tokens(10, seed=7))
    rows = [(decoding, 1), (hit, 6), (fresh, 10), (earlier, 1)]
    starts = [seq.num_computed_tokens for seq, _ in rows]
    outputs = session.step(rows)
    for (seq, num_new), start, logits in zip(rows, starts, outputs, strict=True):
        reference = hf_logits(folder, seq.token_ids)[start : start + num_new]
        assert_close(logits, reference)
    # The prefix request's blocks were read, never rewritten: the earlier request still decodes.
    (logits,) = session.step([(earlier, 1)])
    assert_close(logits, hf_logits(folder, earlier.token_ids)[-2:-1])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_model_exposes_cache_spec_and_generation_info(arch, tiny_model_dir):
    model = load(tiny_model_dir(arch))
    spec = model.kv_cache_spec
    expected_kv_heads = 2 if arch == "llama" else 4
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, expected_kv_heads, 16)
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, expected_kv_heads, 16)
    assert spec.dtype == torch.float32
    assert model.vocab_size == VOCAB
    assert model.eos_token_ids == (2,) and model.eos_token_id == 2
    assert model.max_model_len == (256 if arch == "llama" else 128)


def test_kv_cache_spec_bytes_per_block():
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    assert spec.bytes_per_block(16) == 2 * 30 * 16 * 3 * 64 * 2
    assert spec.bytes_per_block(16, torch.float32) == 2 * 30 * 16 * 3 * 64 * 4
    assert spec.layer_shape(10, 16) == (2, 10, 16, 3, 64)
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVCacheSpec(num_layers=1, num_kv_heads=0, head_dim=8, dtype=torch.float32)


def test_empty_cache_profile_run_returns_hidden_states(tiny_model_dir, make_session):
    """A memory-profiling forward before the cache exists (empty kv tensors) still runs."""
    model = load(tiny_model_dir("llama"))
    session = make_session(model)
    input_ids, positions, metadata = session.build_step([(SeqState(random_tokens(9, 8)), 9)])
    empty = [torch.empty(0) for _ in range(model.num_layers)]
    with torch.no_grad():
        hidden = model(input_ids, positions, empty, metadata)
    assert hidden.shape == (9, 64) and torch.isfinite(hidden).all()


@pytest.mark.parametrize("rope", ["linear", "dynamic", "yarn"])
def test_scaled_rope_matches_hf(rope):
    """cos/sin of the scaled RoPE variants equal HF's rotary embedding's (within the context)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": rope, "factor": 4.0, "rope_theta": 10000.0}
    if rope == "yarn":
        params["original_max_position_embeddings"] = 32
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=128, rope_parameters=params
    )
    positions = torch.arange(0, 128, 7)
    ours = RotaryEmbedding.from_config(config, head_dim=16)
    cos, sin = ours.cos_sin(positions)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])
    torch.testing.assert_close(cos[:, 0], hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], hf_sin[0], atol=1e-6, rtol=0)


def test_tensor_parallel_shards_sum_to_the_full_layer():
    """Two ranks' column/row shards (loaded through weight_loader) reproduce the full layers."""
    torch.manual_seed(0)
    hidden, heads, kv_heads, head_dim, inter = 16, 4, 2, 4, 24
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, 16)
    x = torch.randn(5, hidden)
    full_qkv = torch.cat([x @ q.T, x @ k.T, x @ v.T], dim=-1)
    per_rank_qkv, per_rank_gate_up, row_sum = [], [], torch.zeros(5, hidden)
    for rank in range(2):
        qkv = QKVLinear(hidden, head_dim, heads, kv_heads, tp_rank=rank, tp_size=2)
        for shard, weight in zip("qkv", (q, k, v), strict=True):
            qkv.weight.weight_loader(qkv.weight, weight, shard)
        per_rank_qkv.append(qkv.split(qkv(x)))
        gate_up = MergedColumnLinear(hidden, [inter, inter], tp_rank=rank, tp_size=2)
        gate_up.weight.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, up, 1)
        per_rank_gate_up.append(gate_up(x).chunk(2, dim=-1))
        row = RowLinear(16, hidden, bias=True, tp_rank=rank, tp_size=2, reduce_results=False)
        row.weight.weight_loader(row.weight, down)
        row.bias.weight_loader(row.bias, torch.ones(hidden))
        row_sum += row(x[:, :16].narrow(1, rank * 8, 8))
    for part, (start, size) in enumerate([(0, 16), (16, 8), (24, 8)]):
        merged = torch.cat([rank_out[part] for rank_out in per_rank_qkv], dim=-1)
        torch.testing.assert_close(merged, full_qkv[:, start : start + size])
    torch.testing.assert_close(torch.cat([g for g, _ in per_rank_gate_up], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([u for _, u in per_rank_gate_up], -1), x @ up.T)
    torch.testing.assert_close(row_sum, x[:, :16] @ down.T + 1.0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # native layers and the fallback's hook
def test_attention_backend_is_pluggable(arch, tiny_model_dir, hf_logits, make_session, monkeypatch):
    calls = []

    def counting_paged_attention(*args, **kwargs):
        calls.append(1)
        return TORCH_ATTENTION.paged_attention(*args, **kwargs)

    ops = AttentionOps("triton", TORCH_ATTENTION.reshape_and_cache, counting_paged_attention)
    monkeypatch.setitem(attention._BACKENDS, "triton", ops)
    assert resolve_attention_backend("auto", torch.device("cuda")) is ops
    assert resolve_attention_backend("auto", torch.device("cpu")).name == "cpu"
    folder = tiny_model_dir(arch)
    config = ModelConfig(model=str(folder), attention_backend="triton")
    model = load_model(replace(config, dtype="float32"), device="cpu")
    seq = SeqState(random_tokens(9, seed=9))
    (logits,) = make_session(model).step([(seq, 9)])
    assert len(calls) == model.num_layers
    assert_close(logits, hf_logits(folder, seq.token_ids))


def test_unavailable_attention_backend_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="'triton' is not available"):
        resolve_attention_backend("triton", torch.device("cpu"))
    config = ModelConfig(model=str(tiny_model_dir("llama")), attention_backend="triton")
    with pytest.raises(ValueError, match="not available"):
        load_model(config, device="cpu")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_checkpoint_with_stacked_experts(arch, tmp_path, make_session):
    """A checkpoint that holds each layer's experts stacked, as transformers 5 names them
    in memory (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]),
    loads expert by expert and gives HF's logits."""
    from safetensors.torch import save_file

    from tests.helpers.tiny_models import build_tiny_model

    hf = build_tiny_model(arch, seed=3)
    state = {name: tensor.contiguous() for name, tensor in hf.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    hf.config.save_pretrained(tmp_path)
    session = make_session(load(tmp_path))
    seq = SeqState(random_tokens(17, seed=8))
    (logits,) = session.step([(seq, 17)])
    with torch.no_grad():
        reference = hf(torch.tensor([seq.token_ids])).logits[0]
    assert_close(logits, reference)
