"""LoRAConfig: the engine's LoRA limits (vLLM's `enable_lora`, `max_loras`, `max_lora_rank`,
`max_cpu_loras`), as the operator set them; LoRATargets: what the loaded base model offers
adapters (its target linears and layers), found by the worker, never configured.

Torch-free: the command line, the scheduler (admission by max_loras), the frontend (an
adapter is checked against the targets before any request uses it) and the worker read
them; both travel in ModelCapabilities.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# The linears an adapter may target, by their HF names (Llama family).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_MAX_LORAS = 1  # vLLM's defaults
DEFAULT_MAX_LORA_RANK = 16


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = DEFAULT_MAX_LORAS  # adapters in one step (the workers' slots)
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None  # adapters each worker keeps loaded (None: max_loras)

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(
                f"max_cpu_loras ({cpu!r}) must be an integer >= max_loras ({self.max_loras})."
            )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class LoRATargets:
    """The base model's linears an adapter may target: HF module name -> (in_features,
    out_features) of the whole (unsharded) linear, and its number of decoder layers."""

    modules: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    num_layers: int = 0

    def __post_init__(self) -> None:
        shapes = {name: tuple(shape) for name, shape in self.modules.items()}
        object.__setattr__(self, "modules", shapes)
