"""ModelCapabilities <-> pagestream.v1.ModelCapabilities: each part field by field (an
unset sub-message is a part that is off)."""

from __future__ import annotations

from services.common.lora_config import LoRAConfig, LoRATargets
from services.common.model_capabilities import ModelCapabilities
from services.common.pooler_config import PoolerConfig
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.speculative_config import SpeculativeConfig


def capabilities_to_pb(capabilities: ModelCapabilities) -> pb.ModelCapabilities:
    message = pb.ModelCapabilities(can_generate=capabilities.can_generate)
    if capabilities.pooler is not None:
        message.pooler.CopyFrom(_pooler_to_pb(capabilities.pooler))
    if capabilities.lora is not None:
        targets = capabilities.lora_targets or LoRATargets()
        message.lora.CopyFrom(_lora_to_pb(capabilities.lora, targets))
    if capabilities.speculative is not None:
        message.speculative.CopyFrom(_speculative_to_pb(capabilities.speculative))
    return message


def capabilities_from_pb(message: pb.ModelCapabilities) -> ModelCapabilities:
    lora = message.lora if message.HasField("lora") else None
    return ModelCapabilities(
        can_generate=message.can_generate,
        pooler=_pooler_from_pb(message.pooler) if message.HasField("pooler") else None,
        lora=_lora_from_pb(lora) if lora is not None else None,
        lora_targets=_targets_from_pb(lora) if lora is not None else None,
        speculative=(
            _speculative_from_pb(message.speculative) if message.HasField("speculative") else None
        ),
    )


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


def _pooler_to_pb(pooler: PoolerConfig) -> pb.PoolerCapability:
    return pb.PoolerCapability(
        pooling_type=pooler.pooling_type or "",
        normalize=pooler.normalize,
        dimensions=pooler.dimensions,
        hidden_size=pooler.hidden_size,
        matryoshka_dimensions=pooler.matryoshka_dimensions,
        whole_prompt=pooler.whole_prompt,
        num_labels=pooler.num_labels,
        score_activation=pooler.score_activation,
        labels=pooler.labels,
        prompts=pooler.prompts,
        default_prompt_name=pooler.default_prompt_name,
        chat_template_inputs=pooler.chat_template_inputs,
    )


def _pooler_from_pb(message: pb.PoolerCapability) -> PoolerConfig:
    return PoolerConfig(
        pooling_type=message.pooling_type or None,
        normalize=_optional(message, "normalize"),
        dimensions=_optional(message, "dimensions"),
        hidden_size=message.hidden_size,
        matryoshka_dimensions=tuple(message.matryoshka_dimensions),
        whole_prompt=message.whole_prompt,
        num_labels=message.num_labels,
        score_activation=message.score_activation,
        labels=tuple(message.labels),
        prompts=dict(message.prompts),
        default_prompt_name=_optional(message, "default_prompt_name"),
        chat_template_inputs=message.chat_template_inputs,
    )


def _lora_to_pb(lora: LoRAConfig, targets: LoRATargets) -> pb.LoRACapability:
    return pb.LoRACapability(
        max_loras=lora.max_loras,
        max_lora_rank=lora.max_lora_rank,
        max_cpu_loras=lora.max_cpu_loras,
        modules={
            name: pb.LinearShape(in_features=shape[0], out_features=shape[1])
            for name, shape in targets.modules.items()
        },
        num_layers=targets.num_layers,
    )


def _lora_from_pb(message: pb.LoRACapability) -> LoRAConfig:
    return LoRAConfig(
        max_loras=message.max_loras,
        max_lora_rank=message.max_lora_rank,
        max_cpu_loras=_optional(message, "max_cpu_loras"),
    )


def _targets_from_pb(message: pb.LoRACapability) -> LoRATargets:
    modules = {name: (s.in_features, s.out_features) for name, s in message.modules.items()}
    return LoRATargets(modules, message.num_layers)


def _speculative_to_pb(speculative: SpeculativeConfig) -> pb.SpeculativeCapability:
    return pb.SpeculativeCapability(
        method=speculative.method,
        num_speculative_tokens=speculative.num_speculative_tokens,
        prompt_lookup_min=speculative.prompt_lookup_min,
        prompt_lookup_max=speculative.prompt_lookup_max,
        model=speculative.model,
        disable_by_batch_size=speculative.disable_by_batch_size,
    )


def _speculative_from_pb(message: pb.SpeculativeCapability) -> SpeculativeConfig:
    return SpeculativeConfig(
        method=message.method,
        num_speculative_tokens=message.num_speculative_tokens,
        prompt_lookup_min=message.prompt_lookup_min,
        prompt_lookup_max=message.prompt_lookup_max,
        model=_optional(message, "model"),
        disable_by_batch_size=message.disable_by_batch_size,
    )
