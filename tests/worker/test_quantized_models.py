"""Quantized models end to end, on tiny random models quantized in the test: GGUF files in
every block format our kernels run (gguf's writer; gguf's own quantization for Q8_0 / Q4_0 /
Q4_1 / Q5_0 / Q5_1, random blocks for the others), and float checkpoints quantized online to int8 /
int4. The reference is HF transformers in float32 on the same de-quantized weights (the
weights differ from the float model's, so the float model is no reference), compared by
greedy tokens with the near-tie rule of the parallel tests; the native CPU step runs the
quantized kernels, `enforce_eager=True` the torch modules on weights de-quantized at
load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from pagestream import LLM, SamplingParams
from services.common.model_errors import ModelLoadError
from services.common.model_source import resolve_model
from services.worker.layers.quantization import quantize_int4, quantize_int8
from tests.helpers.parallel import assert_same_or_near_tie
from tests.helpers.tiny_gguf import reference_folder, write_tiny_gguf
from tests.helpers.tiny_models import build_tiny_model

PROMPTS = [[5, 17, 200, 31, 64, 9], [3, 3, 3, 99, 150, 22, 7, 8, 41, 120, 77, 5, 6, 250]]
ENGINE = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_num_batched_tokens": 64}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
SMALL_BLOCKS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")  # 32 elements a block


def _tiny(k_quant: bool, arch: str = "llama"):
    head_dim = 128 if arch == "qwen3" else 64  # Qwen3: heads * head_dim != hidden
    sizes = {"hidden_size": 256, "intermediate_size": 512, "head_dim": head_dim} if k_quant else {}
    name = {"llama": "llama_tied", "qwen2": "qwen2", "qwen3": "qwen3"}[arch]
    return build_tiny_model(name, seed=3, vocab_size=300, **sizes)


def _greedy(llm: LLM, max_tokens: int = 12) -> list[list[int]]:
    # EOS banned until the end, as HF's min_new_tokens does in _hf_greedy
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs]


def _hf_greedy(folder: Path, max_tokens: int = 12) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
            )
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def _assert_matches(reference: Path, got: list[list[int]]) -> None:
    for prompt, tokens, expected in zip(PROMPTS, got, _hf_greedy(reference), strict=True):
        assert_same_or_near_tie(reference, prompt, tokens, expected)


@pytest.mark.parametrize("matrix_type", [*SMALL_BLOCKS, *K_QUANTS, "Q2_K", "Q3_K", "IQ4_XS"])
def test_gguf_formats_match_hf_on_the_dequantized_weights(matrix_type, tmp_path, model_cache):
    path = tmp_path / f"tiny.{matrix_type}.gguf"
    expected = write_tiny_gguf(path, _tiny(matrix_type not in SMALL_BLOCKS), matrix_type)
    reference = reference_folder(resolve_model(path), expected, tmp_path / "reference")
    llm = LLM(str(path), quantization="gguf", **ENGINE)
    info = llm.engine.model_info
    assert info.quantization == matrix_type  # every matrix, the tied embedding included
    worker_model = llm.engine.worker.model
    assert worker_model.model.native is not None  # the quantized C++ kernels ran
    _assert_matches(reference, _greedy(llm))


def test_a_q4_k_m_like_mix_keeps_each_part_in_its_format(tmp_path, model_cache):
    """llama.cpp's Q4_K_M: Q4_K matrices with Q6_K value and down projections and a Q6_K
    embedding. The fused QKV's parts stay in their own formats on the native step (one C++
    linear each, stacked), and greedy output matches HF on the de-quantized weights."""
    path = tmp_path / "tiny.Q4_K_M.gguf"
    mix = {"v_proj": "Q6_K", "down_proj": "Q6_K", "embed_tokens": "Q6_K"}
    expected = write_tiny_gguf(path, _tiny(True), "Q4_K", overrides=mix)
    reference = reference_folder(resolve_model(path), expected, tmp_path / "reference")
    llm = LLM(str(path), quantization="gguf", **ENGINE)
    assert llm.engine.model_info.quantization == "Q4_K+Q6_K"
    layer = llm.engine.worker.model.model.layers[0]
    qkv = layer.self_attn.qkv_proj.weight_format
    assert qkv.format == "Q4_K+Q6_K"  # the stacked C++ linear: no part widened
    linear = layer.self_attn.qkv_proj
    # one 8-bit form with float32 scales and mins per 16, as a join would widen it to
    widened = linear.output_size * linear.input_size * 1.5
    assert qkv.nbytes < 0.75 * widened
    _assert_matches(reference, _greedy(llm))


def test_qwen2_gguf_with_biases(tmp_path, model_cache):
    path = tmp_path / "tiny-qwen2.Q4_1.gguf"
    expected = write_tiny_gguf(path, _tiny(False, "qwen2"), "Q4_1", arch="qwen2")
    reference = reference_folder(resolve_model(path), expected, tmp_path / "reference")
    _assert_matches(reference, _greedy(LLM(str(path), quantization="gguf", **ENGINE)))


@pytest.mark.parametrize("native", [True, False])
def test_qwen3_gguf_with_head_norms_and_its_own_head_dim(native, tmp_path, model_cache):
    """Qwen3's per-head query / key norms (F32 tensors of the file) and a head_dim that is
    not hidden / heads (the file's key_length), in a Q4_K_M-like mix."""
    path = tmp_path / "tiny-qwen3.Q4_K_M.gguf"
    model = _tiny(True, "qwen3")
    assert model.config.head_dim * model.config.num_attention_heads != model.config.hidden_size
    mix = {"v_proj": "Q6_K", "down_proj": "Q6_K", "embed_tokens": "Q6_K"}
    expected = write_tiny_gguf(path, model, "Q4_K", arch="qwen3", overrides=mix)
    reference = reference_folder(resolve_model(path), expected, tmp_path / "reference")
    llm = LLM(str(path), quantization="gguf", **ENGINE, enforce_eager=not native)
    assert type(llm.engine.worker.model).__name__ == "Qwen3ForCausalLM"
    assert (llm.engine.worker.model.model.native is not None) == native
    _assert_matches(reference, _greedy(llm))


@pytest.mark.parametrize("native", [True, False])
def test_gemma3_gguf_with_its_four_norms_and_local_layers(native, tmp_path, model_cache):
    """A Gemma-3-shaped file as llama.cpp writes it: norms stored as 1 + w, ffn_norm the
    MLP's input norm, 5 sliding layers to 1 global (the pattern the file implies) with
    linear rotary scaling on the global one, the attention scale of head_dim; a Q4_K_M-like
    mix (Q4_K, Q6_K for the values and down, Q8_0 embedding)."""
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    model = build_tiny_model(
        "gemma3",
        seed=3,
        vocab_size=300,
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        num_hidden_layers=6,
        layer_types=layer_types,
        query_pre_attn_scalar=64,
        final_logit_softcapping=None,
    )
    path = tmp_path / "tiny-gemma3.Q4_K_M.gguf"
    mix = {"v_proj": "Q6_K", "down_proj": "Q6_K", "embed_tokens": "Q8_0"}
    expected = write_tiny_gguf(path, model, "Q4_K", arch="gemma3", overrides=mix)
    converted = AutoConfig.from_pretrained(resolve_model(path))
    assert converted.layer_types == layer_types and converted.sliding_window == 6
    assert converted.rope_parameters["full_attention"]["factor"] == 2.0
    reference = reference_folder(resolve_model(path), expected, tmp_path / "reference")
    model.config.save_pretrained(reference)  # HF under the checkpoint's own config
    llm = LLM(str(path), quantization="gguf", **ENGINE, enforce_eager=not native)
    assert type(llm.engine.worker.model).__name__ == "Gemma3ForCausalLM"
    assert (llm.engine.worker.model.model.native is not None) == native
    # prompts past the 6-token window
    _assert_matches(reference, _greedy(llm))
    # and the log-probabilities (Gemma's norms make greedy tokens nearly blind to a scale)
    _assert_logprobs_match(reference, llm)


@pytest.mark.parametrize("native", [True, False])
def test_phi3_gguf_with_fused_tensors_and_longrope(native, tmp_path, model_cache):
    """A Phi-4-mini-shaped file as llama.cpp writes it: the fused attn_qkv and ffn_up (gate
    then up rows) kept quantized as they are, 3/4 of each head rotated (rope.dimension_count)
    with longrope's factors as the rope_factors_short / _long tensors, tied embeddings."""
    model = build_tiny_model("phi4", seed=3, vocab_size=300)
    path = tmp_path / "tiny-phi4.Q5_0.gguf"  # widths of 64 / 96: blocks of 32
    mix = {"down_proj": "Q8_0", "embed_tokens": "Q8_0"}
    expected = write_tiny_gguf(path, model, "Q5_0", arch="phi3", overrides=mix)
    converted = AutoConfig.from_pretrained(resolve_model(path))
    rope, original = converted.rope_parameters, model.config.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.75
    for kind in ("short_factor", "long_factor"):
        assert rope[kind] == pytest.approx(original[kind])
    assert converted.original_max_position_embeddings == 128 and converted.tie_word_embeddings
    reference = reference_folder(resolve_model(path), expected, tmp_path / "reference")
    model.config.save_pretrained(reference)  # HF under the checkpoint's own config
    llm = LLM(str(path), quantization="gguf", **ENGINE, enforce_eager=not native)
    assert type(llm.engine.worker.model).__name__ == "Phi3ForCausalLM"
    assert (llm.engine.worker.model.model.native is not None) == native
    assert llm.engine.model_info.quantization == "Q5_0+Q8_0"  # kept quantized
    _assert_matches(reference, _greedy(llm))
    _assert_logprobs_match(reference, llm)


@pytest.mark.parametrize("native", [True, False])
def test_smollm3_gguf_with_its_layers_without_rotary(native, tmp_path, model_cache):
    """A SmolLM3 file as llama.cpp writes it ("smollm3": a llama file in all but the name,
    query / key rows permuted): every 4th layer without rotary, as llama.cpp assumes; its
    config and tokenizer read through a "llama" twin of the metadata, kept quantized."""
    layers = {"num_hidden_layers": 4, "no_rope_layer_interval": 4, "no_rope_layers": [1, 1, 1, 0]}
    model = build_tiny_model("smollm3", seed=3, vocab_size=300, **layers)
    path = tmp_path / "tiny-smollm3.Q8_0.gguf"
    expected = write_tiny_gguf(path, model, "Q8_0", arch="smollm3")
    converted = AutoConfig.from_pretrained(resolve_model(path))
    assert converted.model_type == "smollm3" and converted.no_rope_layers == [1, 1, 1, 0]
    assert converted.tie_word_embeddings == model.config.tie_word_embeddings is False
    assert not (resolve_model(path) / "llama-twin.gguf").exists()
    reference = reference_folder(resolve_model(path), expected, tmp_path / "reference")
    llm = LLM(str(path), quantization="gguf", **ENGINE, enforce_eager=not native)
    assert type(llm.engine.worker.model).__name__ == "SmolLM3ForCausalLM"
    assert (llm.engine.worker.model.model.native is not None) == native
    assert llm.engine.model_info.quantization == "Q8_0"
    _assert_matches(reference, _greedy(llm))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_gguf_with_stacked_quantized_experts(family, native, tmp_path, model_cache):
    """A Qwen3-MoE / Qwen2-MoE / Mixtral file as llama.cpp writes it: each layer's experts
    stacked per projection ([experts, rows, K], Q4_K and Q6_K for down), the router F32,
    Qwen2-MoE's shared expert and its gate, the experts' widths in the metadata, Mixtral as
    a "llama" file with experts (its query / key rows permuted); kept quantized, expert by
    expert."""
    width = 256  # the experts' (Mixtral's: intermediate_size)
    sizes = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": width}
    if family == "qwen2_moe":  # every layer sparse, as llama.cpp's qwen2moe has them
        sizes.update(shared_expert_intermediate_size=512, mlp_only_layers=[])
    elif family == "qwen3_moe":
        sizes["head_dim"] = 64
    else:
        width = sizes.pop("moe_intermediate_size")
        sizes.update(intermediate_size=width, head_dim=64)
    model = build_tiny_model(family, seed=3, vocab_size=300, **sizes)
    path = tmp_path / f"tiny-{family}.Q4_K_M.gguf"
    mix = {"down": "Q6_K", "v_proj": "Q6_K", "embed_tokens": "Q8_0"}
    arch = "llama" if family == "mixtral" else family.replace("_", "")
    expected = write_tiny_gguf(path, model, "Q4_K", arch=arch, overrides=mix)
    converted = AutoConfig.from_pretrained(resolve_model(path))
    assert converted.model_type == model.config.model_type
    assert getattr(converted, "moe_intermediate_size", converted.intermediate_size) == width
    if family == "mixtral":  # the names transformers reads Mixtral checkpoints under
        expected = {_mixtral_name(name): value for name, value in expected.items()}
    reference = reference_folder(resolve_model(path), expected, tmp_path / "reference")
    model.config.save_pretrained(reference)  # HF under the checkpoint's own config
    llm = LLM(str(path), quantization="gguf", **ENGINE, enforce_eager=not native)
    worker_model = llm.engine.worker.model
    assert (worker_model.model.native is not None) == native
    if native:  # the experts stay in the file's blocks
        assert "Q4_K" in llm.engine.model_info.quantization
    _assert_matches(reference, _greedy(llm))


def _mixtral_name(name: str) -> str:
    """HF's per-expert name -> Mixtral's (block_sparse_moe, w1 / w3 / w2)."""
    for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        name = name.replace(f".{ours}.", f".{theirs}.") if ".experts." in name else name
    return name.replace(".mlp.", ".block_sparse_moe.")


def _assert_logprobs_match(reference: Path, llm: LLM, max_tokens: int = 8) -> None:
    """Each generated token's log-probability equals HF's on the same sequence."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
        expected = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        for i, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
            assert entry[token].logprob == pytest.approx(expected[i, token].item(), abs=1e-3)


LLAMA3_SCALINGS = [(8192, 8.0), (16, 4.0)]  # as Meta ships it; a short one (solved, not looked up)


@pytest.mark.parametrize("original, factor", LLAMA3_SCALINGS)
def test_llama3_rotary_scaling_from_the_files_rope_freqs(original, factor, tmp_path, model_cache):
    """llama.cpp stores Llama 3.x's rotary scaling as a rope_freqs tensor only; the config
    gets it back, and the greedy tokens are HF's under the original checkpoint's config."""
    scaling = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }
    model = build_tiny_model(
        "llama_tied",
        seed=3,
        vocab_size=300,
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        rope_parameters=scaling,
    )
    path = tmp_path / "tiny-llama3.Q8_0.gguf"
    expected = write_tiny_gguf(path, model, "Q8_0")
    converted = AutoConfig.from_pretrained(resolve_model(path))
    for key, value in scaling.items():
        # a solved scaling is as exact as the file's float32 factors
        expected_value = value if isinstance(value, str) else pytest.approx(value, rel=1e-6)
        assert converted.rope_parameters[key] == expected_value, key
    reference = reference_folder(resolve_model(path), expected, tmp_path / "reference")
    model.config.save_pretrained(reference)  # HF under the checkpoint's own config
    llm = LLM(str(path), quantization="gguf", **ENGINE)
    _assert_matches(reference, _greedy(llm))


def test_torch_path_dequantizes_at_load(tmp_path, model_cache, caplog):
    path = tmp_path / "tiny.Q4_K.gguf"
    expected = write_tiny_gguf(path, _tiny(True), "Q4_K")
    reference = reference_folder(resolve_model(path), expected, tmp_path / "reference")
    with caplog.at_level("INFO"):
        llm = LLM(str(path), quantization="gguf", **ENGINE, enforce_eager=True)
    assert "de-quantized to float32 at load" in caplog.text
    assert llm.engine.worker.model.model.native is None
    _assert_matches(reference, _greedy(llm))


def test_unset_quantization_keeps_gguf_blocks_only_at_dtype_auto(tmp_path, model_cache):
    path = tmp_path / "tiny.Q8_0.gguf"
    write_tiny_gguf(path, _tiny(False), "Q8_0")
    kept = LLM(str(path), kv_cache_memory="16MiB")
    assert kept.engine.model_info.quantization == "Q8_0"
    floats = LLM(str(path), kv_cache_memory="16MiB", dtype="float32")
    assert floats.engine.model_info.quantization == "none"
    # the resident weights: about the file's tensor bytes when kept, 4x that in float32
    assert kept.engine.model_info.weight_bytes * 3 < floats.engine.model_info.weight_bytes


def _online_reference(folder: Path, method: str, group: int, out: Path) -> Path:
    """The float checkpoint with every linear and the LM head replaced by its quantized
    and de-quantized self (the embedding stays float, so the reference is untied)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    quantize = quantize_int8 if method == "int8" else (lambda w: quantize_int4(w, group))
    for name, tensor in list(state.items()):
        if name.endswith("proj.weight") or name == "lm_head.weight":
            state[name] = quantize(tensor).dequantize()
    model.config.tie_word_embeddings = False
    model.config.save_pretrained(out)
    save_file({n: t.contiguous() for n, t in state.items()}, out / "model.safetensors")
    return out


@pytest.mark.parametrize("method,group", [("int8", 128), ("int4", 32)])
def test_online_quantization_matches_hf_on_the_same_weights(method, group, tmp_path):
    folder = tmp_path / "float"
    hf_model = build_tiny_model("llama_tied", seed=5, vocab_size=300)
    hf_model.save_pretrained(folder)
    reference = _online_reference(folder, method, group, tmp_path / "reference")
    llm = LLM(str(folder), quantization=method, quantization_group_size=group, **ENGINE)
    assert llm.engine.model_info.quantization == method
    _assert_matches(reference, _greedy(llm))


def test_bad_quantization_requests_fail_at_load(tmp_path, model_cache):
    folder = tmp_path / "float"
    build_tiny_model("llama_tied", seed=5, vocab_size=300).save_pretrained(folder)
    with pytest.raises(ModelLoadError, match=r"needs a \.gguf model"):
        LLM(str(folder), quantization="gguf", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="quantization_group_size must be one of 32, 128"):
        LLM(str(folder), quantization="int4", quantization_group_size=64)


def test_load_log_names_each_kind_and_the_resident_bytes(tmp_path, model_cache, caplog):
    path = tmp_path / "tiny.Q4_K.gguf"
    write_tiny_gguf(path, _tiny(True), "Q4_K")
    with caplog.at_level("INFO", logger="services.worker.model_loader"):
        LLM(str(path), kv_cache_memory="16MiB")
    line = next(r.getMessage() for r in caplog.records if "resident" in r.getMessage())
    kinds = ("embed_tokens", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
    for kind in kinds:
        assert f"{kind} Q4_K" in line
    assert re.search(r"; \d+\.\d MB resident", line)


def test_unsupported_block_types_are_refused_naming_type_and_tensor(tmp_path, model_cache):
    path = tmp_path / "tiny.IQ2_XXS.gguf"
    write_tiny_gguf(path, _tiny(True), "IQ2_XXS")
    with pytest.raises(ModelLoadError, match=r"GGUF tensor token_embd\.weight is IQ2_XXS"):
        LLM(str(path), kv_cache_memory="16MiB")
    # asked for, the file runs de-quantized
    llm = LLM(str(path), quantization="none", dtype="float32", kv_cache_memory="16MiB")
    assert llm.engine.model_info.quantization == "none"
