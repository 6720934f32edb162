"""FrontendSource: where the Generation servicer finds the Frontend a call's `model` names.

A call holds its Frontend (`async with source.hold(model, keep_alive) as frontend`) for its
whole duration, a Generate stream until its last message: a multi-model source keeps the
model loaded that long. OneFrontend is the one-model serve's (and the split frontend's):
its Frontend, once ready, under its served name. The multi-model serve's source is
pagestream/models/registry_frontends.py.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.common.engine_errors import EngineUnavailableError
from services.frontend.frontend import Frontend
from services.frontend.openai.exceptions import ModelNotFoundError

MAX_NAME_ECHO = 256  # a client's model name, as an error message repeats it


@dataclass(frozen=True)
class ModelListing:
    """One model as ListModels shows it."""

    name: str
    state: str  # unloaded, loading, loaded, unloading, failed
    error: str | None = None
    pinned: bool = False
    max_model_len: int = 0  # while loaded


class FrontendSource(abc.ABC):
    @abc.abstractmethod
    def hold(
        self, model: str | None, keep_alive: str | None
    ) -> contextlib.AbstractAsyncContextManager[Frontend]:
        """The Frontend serving `model` (None: the default), held while the context is
        open. Raises ModelNotFoundError for a name it does not serve, ValueError for a bad
        keep_alive, EngineUnavailableError while the model cannot serve."""

    @abc.abstractmethod
    def models(self) -> tuple[str, list[ModelListing]]:
        """(the default model's name, every model served)."""


class OneFrontend(FrontendSource):
    """One Frontend (None until it is ready: calls answer UNAVAILABLE); `model` must be its
    served name, as the OpenAI routes check it; keep_alive means nothing here."""

    def __init__(self, frontend: Frontend | None = None) -> None:
        self.frontend = frontend

    def ready(self) -> Frontend:
        if self.frontend is None:
            raise EngineUnavailableError("the frontend is starting: the engine is not ready yet.")
        return self.frontend

    @contextlib.asynccontextmanager
    async def hold(self, model: str | None, keep_alive: str | None) -> AsyncIterator[Frontend]:
        frontend = self.ready()
        if model is not None and model != frontend.info.model:
            if frontend.input_processor.loras.get(model) is not None:
                raise ValueError(f"model: `{model}` is a LoRA adapter; name it in lora_name.")
            raise ModelNotFoundError(model[:MAX_NAME_ECHO])
        yield frontend

    def models(self) -> tuple[str, list[ModelListing]]:
        info = self.ready().info
        listing = ModelListing(info.model, "loaded", pinned=True, max_model_len=info.max_model_len)
        return info.model, [listing]
