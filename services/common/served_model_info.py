"""ServedModelInfo: what a frontend needs to know about the model behind the engine core."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.model_capabilities import ModelCapabilities


@dataclass(frozen=True)
class ServedModelInfo:
    model: str  # the served model name (path or alias)
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int = 16
    architecture: str = ""
    dtype: str = ""
    num_device_blocks: int = 0
    quantization: str = "none"
    weight_bytes: int = 0
    # what the model can do: generate, pool, LoRA, the speculative decoding it runs
    capabilities: ModelCapabilities = field(default_factory=ModelCapabilities)

    @property
    def runner(self) -> str:
        return self.capabilities.runner

    @property
    def speculative_decoding(self) -> str:
        """The speculative decoding in use ("ngram k=4", "draft_model k=3"), "" when off."""
        speculative = self.capabilities.speculative
        return speculative.describe() if speculative is not None else ""

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None
