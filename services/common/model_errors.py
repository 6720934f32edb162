"""The one error raised when a model cannot be found, converted or loaded."""

from __future__ import annotations

__all__ = ["ModelLoadError"]


class ModelLoadError(ValueError):
    """A model is missing, corrupt or unsupported; the message says what was looked for
    and how to fix it."""
