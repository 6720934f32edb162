"""The one error raised when a model cannot be found, converted or loaded (shared with the
frontend, which resolves model names too)."""

from services.common.model_errors import ModelLoadError

__all__ = ["ModelLoadError"]
