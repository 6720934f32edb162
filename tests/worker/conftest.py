"""Fixtures over the tiny random HF models (tests/helpers/tiny_models.py), saved as real
folders so the real loading path is exercised, and the paged session that drives them
(tests/helpers/paged_session.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.helpers.model_cache import isolated_model_cache
from tests.helpers.paged_session import PagedSession
from tests.helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> folder with config.json + model.safetensors (built once per session)."""
    folders: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in folders:
            folder = tmp_path_factory.mktemp(f"tiny-{name}")
            build_tiny_model(name).save_pretrained(folder)
            folders[name] = folder
        return folders[name]

    return get


@pytest.fixture(scope="session")
def hf_logits() -> Callable[[Path, list[int]], torch.Tensor]:
    """(folder, token_ids) -> HF transformers eager float32 logits [len, vocab]."""
    models: dict[Path, PreTrainedModel] = {}

    def run(folder: Path, token_ids: list[int]) -> torch.Tensor:
        if folder not in models:
            models[folder] = AutoModelForCausalLM.from_pretrained(
                folder, attn_implementation="eager", dtype=torch.float32
            ).eval()
        with torch.no_grad():
            ids = torch.tensor([token_ids])
            return models[folder](input_ids=ids).logits[0].float()

    return run


@pytest.fixture
def make_session() -> Callable[..., PagedSession]:
    return PagedSession


@pytest.fixture
def model_cache(tmp_path, monkeypatch) -> Path:
    return isolated_model_cache(tmp_path / "cache", monkeypatch)
