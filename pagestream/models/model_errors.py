"""Why a request to one model of many cannot be served (each maps to an HTTP status by the
shared engine refusals: unavailable -> 503, overloaded -> 429)."""

from __future__ import annotations

from services.common.engine_errors import EngineOverloadedError, EngineUnavailableError


class ModelLoadFailedError(EngineUnavailableError):
    """The model's last load failed; it stays failed until POST /models/load tries again."""

    def __init__(self, name: str, error: str) -> None:
        super().__init__(f"model `{name}` failed to load: {error} (POST /models/load tries again).")


class ModelMemoryError(EngineUnavailableError):
    """The model would not fit the memory left, even with every idle model unloaded."""


class ModelsBusyError(EngineOverloadedError):
    """--models-max models are loaded and busy: no slot came free in time."""
