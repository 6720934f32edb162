"""Which model class runs a checkpoint: native for the Llama family (its dense and
mixture-of-experts members, and the vision-language models built on it), else the HF
fallback."""

from __future__ import annotations

from collections.abc import Sequence

from services.worker.models.bert import BertEncoder
from services.worker.models.causal_lm import CausalLM
from services.worker.models.gemma3_vlm import Gemma3ForConditionalGeneration
from services.worker.models.idefics3 import Idefics3ForConditionalGeneration
from services.worker.models.llama import (
    Gemma3ForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    SmolLM3ForCausalLM,
)
from services.worker.models.llava import LlavaForConditionalGeneration
from services.worker.models.mixture_of_experts import (
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from services.worker.models.modernbert import ModernBertEncoder
from services.worker.models.nomic_bert import NomicBertEncoder
from services.worker.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

# HF `architectures` name -> native implementation.
NATIVE_MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    # vision-language models: a vision encoder beside the Llama text model
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    # base-model checkpoints (saved by AutoModel: no LM head), for the pooling runner
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": MistralForCausalLM,
    "Qwen2Model": Qwen2ForCausalLM,
    "Qwen3Model": Qwen3ForCausalLM,
    "SmolLM3Model": SmolLM3ForCausalLM,
    "Gemma3TextModel": Gemma3ForCausalLM,
    "Phi3Model": Phi3ForCausalLM,
    "MixtralModel": MixtralForCausalLM,
    "Qwen2MoeModel": Qwen2MoeForCausalLM,
    "Qwen3MoeModel": Qwen3MoeForCausalLM,
    "OlmoeModel": OlmoeForCausalLM,
    # encoders (the pooling runner only)
    "BertModel": BertEncoder,
    "RobertaModel": BertEncoder,
    "XLMRobertaModel": BertEncoder,
    "MPNetModel": BertEncoder,
    # a masked-LM checkpoint embeds with its encoder (all-mpnet-base-v2 is saved as one)
    "BertForMaskedLM": BertEncoder,
    "RobertaForMaskedLM": BertEncoder,
    "XLMRobertaForMaskedLM": BertEncoder,
    "MPNetForMaskedLM": BertEncoder,
    "BertForSequenceClassification": BertEncoder,  # cross-encoders (rerankers)
    "RobertaForSequenceClassification": BertEncoder,
    "XLMRobertaForSequenceClassification": BertEncoder,
    "MPNetForSequenceClassification": BertEncoder,
    "ModernBertModel": ModernBertEncoder,
    "ModernBertForMaskedLM": ModernBertEncoder,
    "ModernBertForSequenceClassification": ModernBertEncoder,
    "NomicBertModel": NomicBertEncoder,
    "NomicBertForMaskedLM": NomicBertEncoder,
    "NomicBertForSequenceClassification": NomicBertEncoder,
}


def native_model_class(architectures: Sequence[str] | None) -> type[CausalLM] | None:
    """The native class for the first supported architecture, or None (use the fallback)."""
    for name in architectures or ():
        if name in NATIVE_MODELS:
            return NATIVE_MODELS[name]
    return None


def native_families() -> str:
    """The native families by name, for messages ("Gemma3, Llama, ...")."""
    names = {
        cls.__name__.removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration")
        for cls in NATIVE_MODELS.values()
    }
    return ", ".join(sorted(names))
