"""Transitional: model-name resolution lives in services/common/model_source.py.

This module only keeps the old import path working until its last importers move
(services/worker/model_loader.py, pagestream/roles.py, pagestream/llm_engine.py,
pagestream/bench.py, benchmarks/); then it goes. Until services/worker/models/errors.py
re-exports services.common.model_errors.ModelLoadError, resolve_model here raises the
worker's ModelLoadError, so the worker's callers see one error class.
"""

from __future__ import annotations

import os
from pathlib import Path

from services.common import model_source
from services.common.model_source import (
    CACHE_ENV,
    DEFAULT_GGUF_FILE,
    DEFAULT_GGUF_PACKAGE,
    MODEL_ALIASES,
    alias_gguf_candidates,
    cache_dir,
)
from services.worker.models.errors import ModelLoadError

__all__ = [
    "CACHE_ENV",
    "DEFAULT_GGUF_FILE",
    "DEFAULT_GGUF_PACKAGE",
    "MODEL_ALIASES",
    "alias_gguf_candidates",
    "cache_dir",
    "resolve_model",
]


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """services.common.model_source.resolve_model, raising the worker's ModelLoadError."""
    try:
        return model_source.resolve_model(name_or_path)
    except model_source.ModelLoadError as exc:
        if isinstance(exc, ModelLoadError):  # one class already: errors.py re-exports it
            raise
        raise ModelLoadError(str(exc)) from exc
