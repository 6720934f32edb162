"""PoolingParams: what one pooling request asks for (vLLM's names).

`task` "embed" returns the pooled vector truncated to `dimensions` (Matryoshka models)
and L2-normalized when `normalize` (default: the pooler's); "encode" returns the raw
pooled hidden state, as the model computed it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common.pooler_config import PoolerConfig

POOLING_TASKS = ("embed", "encode")


@dataclass(frozen=True)
class PoolingParams:
    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    # Keep only the prompt's last k tokens (-1: the last max_model_len); None: all of it
    # (a prompt over the context is then refused).
    truncate_prompt_tokens: int | None = None
    # One of the model's named prompts (config_sentence_transformers.json: "query",
    # "document", ...) put before a text input; None: the model's default prompt, if any.
    prompt_name: str | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}.")
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
        ):
            raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}.")
        keep = self.truncate_prompt_tokens
        if keep is not None and (
            not isinstance(keep, int) or isinstance(keep, bool) or (keep < 1 and keep != -1)
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be -1 (the context length) or >= 1, got {keep!r}."
            )
        if self.task == "encode" and (self.dimensions is not None or self.normalize):
            raise ValueError(
                "task 'encode' returns the raw pooled state: no dimensions or normalize."
            )

    def verify(self, pooler: PoolerConfig) -> None:
        """ValueError (naming the field) if the engine's pooler cannot honour it."""
        if self.dimensions is not None:
            pooler.check_dimensions(self.dimensions)
        pooler.prompt_text(self.prompt_name)

    def finish(self, pooled: np.ndarray, pooler: PoolerConfig) -> np.ndarray:
        """The request's result from the engine's pooled state [hidden] float32."""
        if self.task == "encode":
            return pooled
        dimensions = self.dimensions or pooler.dimensions
        out = pooled[:dimensions] if dimensions else pooled
        normalize = self.normalize if self.normalize is not None else pooler.normalize
        if normalize:
            norm = float(np.linalg.norm(out))
            out = out / max(norm, 1e-12)
        return out.astype(np.float32, copy=False)
