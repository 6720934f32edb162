"""The reference for pooling: HF transformers' AutoModel last_hidden_state, pooled the way
the engine's pooler says (float32, eager attention)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel

_MODELS: dict[Path, torch.nn.Module] = {}


def hf_hidden(folder: Path, token_ids: list[int]) -> np.ndarray:
    """last_hidden_state [len, hidden] float32."""
    if folder not in _MODELS:
        _MODELS[folder] = AutoModel.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    with torch.no_grad():
        out = _MODELS[folder](input_ids=torch.tensor([token_ids]))
    return out.last_hidden_state[0].float().numpy()


def hf_pooled(folder: Path, token_ids: list[int], pooling_type: str) -> np.ndarray:
    hidden = hf_hidden(folder, token_ids)
    return {"LAST": hidden[-1], "MEAN": hidden.mean(axis=0), "CLS": hidden[0]}[pooling_type]


def normalized(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
