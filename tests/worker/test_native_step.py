"""The native CPU step (services/worker/native_step.py) against the torch modules.

Both paths load the same tiny checkpoint and run the same plans (a chunked prompt, a
prefill over a prefix-cache hit, decode rows, and a sequence with several query rows in
one step, as speculative verification schedules), each into its own cache. float32: every
layer's output equals the torch path's to float32 rounding. bfloat16: the native step
keeps the residual stream, norms and attention in float32 and accumulates its matmuls in
float32, so its layer outputs must stay at least as close to the float32 model's as the
torch bf16 path's are (the tolerance is the torch bf16 path's own distance, measured in
the same run). HF parity through the native path is tests/worker/test_models.py's and
tests/models/test_llm_parity.py's (the native step is the CPU default).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.common.config import ModelConfig
from services.worker.model_loader import load_model
from tests.helpers.paged_session import PagedSession, SeqState
from tests.helpers.tiny_models import random_tokens

ARCHS = [
    *("llama", "llama_tied", "qwen2", "qwen2_sliding", "qwen3", "qwen3_bias", "mistral"),
    *("smollm3", "gemma3", "phi4"),
    *("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"),  # mixtures of experts
]


def _load(folder, dtype: str, native: bool):
    config = ModelConfig(model=str(folder), dtype=dtype, enforce_eager=not native)
    model = load_model(config, device="cpu")
    assert (model.model.native is not None) == native
    return model


def _plans(session: PagedSession) -> list[list[tuple[SeqState, int]]]:
    a = SeqState(random_tokens(23, seed=1))
    b = SeqState(random_tokens(9, seed=2))
    steps = [[(a, 10), (b, 9)], [(a, 13)]]
    c = session.fork_prefix(a, a.token_ids[:12] + random_tokens(6, seed=3), num_blocks=3)
    a.token_ids += random_tokens(3, seed=4)  # three new tokens of a in one step
    b.token_ids += random_tokens(1, seed=5)
    steps.append([(c, 6), (a, 3), (b, 1)])
    return steps


def _layer_outputs(model, folder_dtype_session) -> list[torch.Tensor]:
    """Each step's per-layer outputs [layers, T, hidden] and final logits."""
    session = folder_dtype_session
    outputs = []
    native = model.model.native
    captured: list[torch.Tensor] = []
    hooks = []
    if native is None:
        for layer in model.model.layers:
            hooks.append(layer.register_forward_hook(lambda m, i, o: captured.append(o.float())))
    for rows in _plans(session):
        input_ids, positions, metadata = session.build_step(rows)
        with torch.no_grad():
            if native is not None:
                layers = torch.zeros(model.num_layers, len(input_ids), model.config.hidden_size)
                hidden = native.forward(
                    input_ids, positions, session.kv_caches, metadata, layer_outputs=layers
                )
            else:
                captured.clear()
                hidden = model(input_ids, positions, session.kv_caches, metadata)
                layers = torch.stack(captured)
            logits = model.compute_logits(hidden)
        for seq, num_new in rows:
            seq.num_computed_tokens += num_new
        outputs.append((layers, logits))
    for hook in hooks:
        hook.remove()
    return outputs


def _run(folder, dtype, native):
    model = _load(folder, dtype, native)
    return _layer_outputs(model, PagedSession(model, num_blocks=32, block_size=4))


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_layers_equal_the_torch_path(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    ours = _run(folder, "float32", True)
    reference = _run(folder, "float32", False)
    for (layers, logits), (ref_layers, ref_logits) in zip(ours, reference, strict=True):
        # float32 rounding scales with the residual (Gemma's scaled embeddings reach ~16)
        scale = max(1.0, ref_layers.abs().max().item())
        torch.testing.assert_close(layers, ref_layers, atol=1e-5 * scale, rtol=1e-5)
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


# bfloat16 weights: a relative error of a few 2^-9 (Gemma's random (1 + w) norms, ~2x, on
# both sides of each block weigh it about twice)
BF16_BOUND = {"llama": 2e-2, "qwen2": 2e-2, "gemma3": 4e-2, "qwen2_moe": 2e-2}


@pytest.mark.parametrize("arch", BF16_BOUND)
def test_bfloat16_layers_as_close_to_float32_as_the_torch_path(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    exact = _run(folder, "float32", False)
    ours = _run(folder, "bfloat16", True)
    torch_bf16 = _run(folder, "bfloat16", False)
    for step, ((layers, _), (ref, _), (theirs, _)) in enumerate(
        zip(ours, exact, torch_bf16, strict=True)
    ):
        for i in range(layers.shape[0]):
            ours_err = (layers[i] - ref[i]).norm() / ref[i].norm()
            torch_err = (theirs[i] - ref[i]).norm() / ref[i].norm()
            assert ours_err <= torch_err * 1.1 + 1e-6, (step, i, float(ours_err), float(torch_err))
            assert ours_err < BF16_BOUND[arch]


def test_native_step_is_the_cpu_default(tiny_model_dir):
    model = load_model(ModelConfig(model=str(tiny_model_dir("llama"))), device="cpu")
    assert model.model.native is not None
    # the stack holds the weights: the torch linears' copies are freed, not doubled
    assert model.model.layers[0].mlp.gate_up_proj.weight.numel() == 0


def test_torch_attention_backend_keeps_the_torch_modules(tiny_model_dir):
    config = ModelConfig(model=str(tiny_model_dir("llama")), attention_backend="torch")
    model = load_model(replace(config, dtype="float32"), device="cpu")
    assert model.model.native is None
