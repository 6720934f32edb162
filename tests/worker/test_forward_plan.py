"""The loader's forward plan (services/worker/model_loader.py `plan_forward`): decided once
from the config and the engine settings, and the model built in that form (a torch or a
native decoder, causal or bidirectional attention), nothing switched after construction.

That both decoders give the same outputs is tests/worker/test_native_step.py's; that a
bidirectional Gemma embeds as sentence-transformers does is tests/models/test_encoders.py's.
"""

from __future__ import annotations

import pytest
import torch

from services.common.config import ModelConfig
from services.common.model_errors import ModelLoadError
from services.common.rank_info import RankInfo
from services.worker.layers.attention import TORCH_ATTENTION, Attention, resolve_attention_backend
from services.worker.model_loader import load_model, plan_forward
from services.worker.models.bert import BertEncoder
from services.worker.models.encoder import BidirectionalAttention
from services.worker.models.forward_plan import ForwardPlan
from services.worker.models.llama import (
    Gemma3ForCausalLM,
    LlamaForCausalLM,
    LlamaModel,
    NativeLlamaModel,
)
from services.worker.models.registry import native_model_class
from tests.helpers.tiny_models import tiny_config

CPU = torch.device("cpu")


def _config(name: str):
    config = tiny_config(name)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


def _plan(name: str, pooling: bool = False, dtype=torch.float32, ops=None, **settings):
    config = _config(name)
    ops = ops or resolve_attention_backend("cpu", CPU)
    model_config = ModelConfig(model="unused", **settings)
    model_class = native_model_class(config.architectures)
    return plan_forward(model_class, config, model_config, pooling, ops, dtype, RankInfo())


def test_a_native_family_on_the_cpu_plans_the_native_decoder():
    plan = _plan("llama")
    assert (plan.decoder, plan.attention) == ("native", "causal")
    assert not plan.triton_experts


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        (dict(enforce_eager=True), "--enforce-eager"),
        (dict(ops=TORCH_ATTENTION), "the torch attention backend"),
        (dict(dtype=torch.float16), "the weights are torch.float16"),
    ],
)
def test_the_plan_names_why_the_torch_decoder_runs(settings, reason):
    plan = _plan("llama", **settings)
    assert plan.decoder == "torch" and plan.reason.startswith(reason)


def test_a_bidirectional_gemma_plans_torch_modules_only_when_pooling():
    config = _config("gemma3")
    config.use_bidirectional_attention = True
    ops = resolve_attention_backend("cpu", CPU)
    rank = RankInfo()
    model_config = ModelConfig(model="unused")
    pooled = plan_forward(Gemma3ForCausalLM, config, model_config, True, ops, torch.float32, rank)
    assert (pooled.decoder, pooled.attention) == ("torch", "bidirectional")
    generating = plan_forward(
        Gemma3ForCausalLM, config, model_config, False, ops, torch.float32, rank
    )
    assert (generating.decoder, generating.attention) == ("native", "causal")


def test_an_encoder_plans_bidirectional_torch_modules():
    config = _config("llama")
    ops = resolve_attention_backend("cpu", CPU)
    plan = plan_forward(
        BertEncoder, config, ModelConfig(model="unused"), True, ops, torch.float32, RankInfo()
    )
    assert (plan.decoder, plan.attention) == ("torch", "bidirectional")


def test_a_bidirectional_plan_builds_bidirectional_attention():
    config = _config("gemma3")
    plan = ForwardPlan(attention="bidirectional")
    model = Gemma3ForCausalLM(config, pooling=True, plan=plan)
    assert type(model.model) is LlamaModel
    for layer in model.model.layers:
        assert isinstance(layer.self_attn.attn, BidirectionalAttention)
        assert not isinstance(layer.self_attn.attn, Attention)
    assert model.bidirectional and not model.can_generate
    spec = model.kv_cache_spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (1, 1, 1)
    with pytest.raises(ModelLoadError, match="one rank"):
        Gemma3ForCausalLM(config, RankInfo(tensor_parallel_size=2), pooling=True, plan=plan)


def test_the_loaded_model_is_in_the_plans_form(tiny_model_dir):
    folder = str(tiny_model_dir("llama"))
    native = load_model(ModelConfig(model=folder, dtype="float32"), device="cpu")
    assert type(native.model) is NativeLlamaModel and native.model.native is not None
    eager = ModelConfig(model=folder, dtype="float32", enforce_eager=True)
    torch_model = load_model(eager, device="cpu")
    assert type(torch_model.model) is LlamaModel and torch_model.model.native is None


def test_the_native_build_refuses_weights_the_plan_did_not_promise():
    config = _config("llama")
    model = LlamaForCausalLM(config, plan=ForwardPlan(decoder="native"))
    down = model.model.layers[1].mlp.down_proj
    down.weight.data = down.weight.data.to(torch.float16)
    with pytest.raises(ModelLoadError, match=r"layer 1: down is torch\.float16"):
        model.build_native_step()


def test_a_native_plan_is_causal():
    with pytest.raises(ValueError, match="causally"):
        ForwardPlan(decoder="native", attention="bidirectional")
