"""RegistryFrontends: the public gRPC API's FrontendSource over a multi-model serve's
ModelRegistry. A call's `model` picks the model (unset: the registry's default), loaded on
demand and held by a lease until the call ends; its `keep_alive` reads as HTTP's does."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from pagestream.models.keep_alive import parse_keep_alive
from pagestream.models.model_entry import ModelEntry, ModelState
from pagestream.models.model_registry import ModelRegistry
from services.frontend.frontend import Frontend
from services.frontend.frontend_source import FrontendSource, ModelListing


class RegistryFrontends(FrontendSource):
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    @contextlib.asynccontextmanager
    async def hold(self, model: str | None, keep_alive: str | None) -> AsyncIterator[Frontend]:
        """Raises ModelNotFoundError, ModelLoadFailedError, ModelMemoryError,
        ModelsBusyError (ModelRegistry.acquire) or ValueError for a bad keep_alive (before
        anything loads)."""
        seconds = parse_keep_alive(keep_alive)
        lease = await self.registry.acquire(model, seconds)
        try:
            yield lease.model.frontend
        finally:
            lease.release()  # a cancelled call too: its model may unload once idle

    def models(self) -> tuple[str, list[ModelListing]]:
        entries = self.registry.entries.values()
        return self.registry.default_name, [_listing(e) for e in entries]


def _listing(entry: ModelEntry) -> ModelListing:
    loaded = entry.state is ModelState.LOADED and entry.model is not None
    return ModelListing(
        name=entry.name,
        state=entry.state.value,
        error=entry.error,
        pinned=entry.spec.pinned,
        max_model_len=entry.model.frontend.info.max_model_len if loaded else 0,
    )
