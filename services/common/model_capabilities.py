"""ModelCapabilities: what a loaded model can do, as its workers found it.

One typed value from the worker that loads the model to every reader (the engine-core
builder, the compatibility check, the scheduler's limits, the frontend's input processor
and LoRA registry), carried whole on the wire (`pagestream.v1.ModelCapabilities`,
services/common/convert/capabilities.py): whether it generates, how it pools, its LoRA
limits and target linears, the speculative decoding it runs. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.lora_config import LoRAConfig, LoRATargets
from services.common.pooler_config import PoolerConfig
from services.common.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class ModelCapabilities:
    can_generate: bool = True  # False: a pooling runner whose checkpoint has no LM head
    pooler: PoolerConfig | None = None  # how it pools, resolved (None: the generate runner)
    lora: LoRAConfig | None = None  # its LoRA limits (None: LoRA off)
    lora_targets: LoRATargets | None = None  # the base linears adapters may target
    speculative: SpeculativeConfig | None = None  # the speculative decoding it runs

    @property
    def runner(self) -> str:
        """vLLM's runner: "pooling" (embeddings, scores, classes) or "generate"."""
        return "pooling" if self.pooler is not None else "generate"

    @property
    def max_loras(self) -> int:
        """Adapters one step may hold (0: LoRA off)."""
        return self.lora.max_loras if self.lora is not None else 0
