"""Pooler: pooling requests' pooled vectors, final, in the step that ends each prompt.

The model's last stage returns the final norm's output for every row [T, hidden]. A
decoder's prompt may be chunked over steps: each chunk's rows go into the request's
PoolingState (kept in the InputBatch), and the step that ends the prompt pools it, runs
the head, truncates to `dimensions`, normalizes as the PoolingParams ask and returns it
once, final: the scheduler only forwards it and the frontend only formats it. An
encoder's prompts run whole, one step each. Rows of requests that sample are never read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from services.common.pooler_config import PoolerConfig
from services.worker.step_inputs import PoolingInputs


def resolve_runner(runner: str, folder: Path, hf_config: Mapping) -> str:
    """generate or pooling; auto: pooling for a base-model checkpoint (architectures
    "LlamaModel", "Qwen2Model", ...) or a sentence-transformers folder."""
    if runner != "auto":
        return runner
    architectures = hf_config.get("architectures") or []
    base_model = bool(architectures) and all(
        name.endswith(("Model", "ForSequenceClassification")) and not name.endswith("ForCausalLM")
        for name in architectures
    )
    return "pooling" if base_model or (folder / "modules.json").is_file() else "generate"


def read_hf_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


class Pooler:
    def __init__(self, config: PoolerConfig, head=None) -> None:
        self.config = config  # every field set (PoolerConfig.resolve)
        # what an encoder's pooled vectors go through ([P, hidden] -> [P, out]): a
        # cross-encoder's classifier or the folder's Dense layers (its prompts run whole)
        self.head = head

    def pool(
        self, hidden: torch.Tensor, rows: PoolingInputs
    ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """This step's final pooled vectors (request_id -> [out] float32, only for the
        requests whose prompt ends in this step) and the requests whose chunk could not
        be read (request_id -> why)."""
        kind = self.config.pooling_type
        pooled: dict[str, torch.Tensor] = {}
        errors: dict[str, str] = {}
        for rid, start, end, first, num_prompt, state in zip(
            rows.request_ids,
            rows.row_starts,
            rows.row_ends,
            rows.first_positions,
            rows.num_prompt_tokens,
            rows.states,
            strict=True,
        ):
            if self.config.whole_prompt:  # an encoder's whole prompt, in this step
                pooled[rid] = pool_rows(hidden[start:end].float(), kind)
            elif (error := state.read(hidden[start:end], first, kind)) is not None:
                errors[rid] = error
            elif first + (end - start) == num_prompt:
                pooled[rid] = state.result(hidden[end - 1], kind, num_prompt)
        if not pooled:
            return {}, errors
        stacked = torch.stack(list(pooled.values()))  # [P, hidden]
        if self.head is not None:  # a cross-encoder's classifier, or Dense layers
            stacked = self.head(stacked.to(hidden.dtype)).float()  # [P, out]
        stacked = stacked.detach().cpu().numpy()
        states = dict(zip(rows.request_ids, rows.states, strict=True))
        finals = {
            rid: states[rid].params.finish(stacked[i], self.config) for i, rid in enumerate(pooled)
        }
        return finals, errors


def pool_rows(rows: torch.Tensor, kind: str) -> torch.Tensor:
    """A whole prompt's rows [n, hidden] pooled as sentence-transformers pools them:
    WEIGHTED_MEAN weighs position i by i + 1."""
    if kind == "MEAN":
        return rows.mean(dim=0)
    if kind == "CLS":
        return rows[0]
    if kind == "LAST":
        return rows[-1]
    if kind == "MAX":
        return rows.max(dim=0).values
    weights = torch.arange(1, rows.shape[0] + 1, dtype=rows.dtype, device=rows.device)
    return (rows * weights[:, None]).sum(dim=0) / weights.sum()
