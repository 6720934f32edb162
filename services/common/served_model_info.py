"""ServedModelInfo: what a frontend needs to know about the model behind the engine core."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServedModelInfo:
    model: str  # the served model name (path or alias)
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int = 16
    architecture: str = ""
    dtype: str = ""
    num_gpu_blocks: int = 0
    quantization: str = "none"
    weight_bytes: int = 0
    speculative_decoding: str = ""  # "ngram k=4", "draft_model k=3"; "" when off
    lora_config: str = ""  # the engine's LoRA limits and target linears (LoRAConfig JSON)
    pooler_config: str = ""  # the pooling runner's pooler (PoolerConfig JSON); "": generates
    # A pooling runner generates too when its checkpoint has an LM head.
    can_generate: bool = True

    @property
    def runner(self) -> str:
        """vLLM's runner: "pooling" (embeddings) or "generate"."""
        return "pooling" if self.pooler_config else "generate"

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None
