"""Pooler: a pooling request's part of its pooled hidden state, per step.

The model's last stage returns the final norm's output for every row [T, hidden] (what
HF's `AutoModel` calls last_hidden_state). A pooling request's prompt may be chunked over
several steps, so each step returns only its part: MEAN the sum over the step's rows
(the scheduler adds the parts and divides by the prompt length), LAST the state at the
prompt's last position, CLS the state at position 0, each only in the step that computes
it. Rows of requests that sample are never read.
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

    def parts(self, hidden: torch.Tensor, rows: PoolingInputs) -> dict[str, np.ndarray]:
        """request_id -> its part [hidden] float32 (absent: nothing to add this step); an
        encoder's whole prompts give their final pooled vectors (through the head)."""
        if self.config.whole_prompt:
            return self._whole(hidden, rows)
        kind = self.config.pooling_type
        picked: dict[str, torch.Tensor] = {}
        for rid, start, end, first, num_prompt in zip(
            rows.request_ids,
            rows.row_starts,
            rows.row_ends,
            rows.first_positions,
            rows.num_prompt_tokens,
            strict=True,
        ):
            if kind == "MEAN":
                picked[rid] = hidden[start:end].float().sum(dim=0)
            elif kind == "CLS" and first == 0:
                picked[rid] = hidden[start].float()
            elif kind == "LAST" and first + (end - start) == num_prompt:
                picked[rid] = hidden[end - 1].float()
        if not picked:
            return {}
        stacked = torch.stack(list(picked.values())).cpu().numpy()  # [P, hidden]
        return {rid: stacked[i] for i, rid in enumerate(picked)}

    def _whole(self, hidden: torch.Tensor, rows: PoolingInputs) -> dict[str, np.ndarray]:
        pooled = [
            pool_rows(hidden[start:end].float(), self.config.pooling_type)
            for start, end in zip(rows.row_starts, rows.row_ends, strict=True)
        ]
        if not pooled:
            return {}
        stacked = torch.stack(pooled)  # [P, hidden]
        if self.head is not None:  # a cross-encoder's classifier, or Dense layers
            stacked = self.head(stacked.to(hidden.dtype)).float()  # [P, out]
        stacked = stacked.detach().cpu().numpy()
        return {rid: stacked[i] for i, rid in enumerate(rows.request_ids)}


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
