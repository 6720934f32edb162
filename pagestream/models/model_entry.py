"""ModelEntry: one model's place in the registry, and the states it moves through.

    unloaded -> loading -> loaded -> unloading -> unloaded
                loading -> failed (sticky: POST /models/load tries again)
                loading -> unloaded (no room: --models-max busy, or memory), error kept

`users` counts the requests holding the model or waiting for its load: an entry with users
is never evicted, and its load, once admitted, keeps its slot (`holds_slot`).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from pagestream.models.memory_estimate import Footprint
from pagestream.models.model_spec import ModelSpec


class ModelState(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    FAILED = "failed"


@dataclass(eq=False)
class ModelEntry:
    spec: ModelSpec
    state: ModelState = ModelState.UNLOADED
    error: str | None = None  # the last load's failure or refusal
    model: object | None = None  # the LoadedModel, while loaded
    users: int = 0
    last_used: float = 0.0  # monotonic seconds: the end of its last request (LRU order)
    keep_alive: float | None = None  # the latest request's (None: --idle-unload-seconds)
    holds_slot: bool = False  # counts against --models-max / memory: admitted to load
    footprint: Footprint | None = None  # what it was admitted with
    task: asyncio.Task | None = None  # its load or unload under way

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def evictable(self) -> bool:
        return self.state is ModelState.LOADED and self.users == 0 and not self.spec.pinned

    def status(self) -> dict:
        """/v1/models' `status` (llama-server's router shape, plus the error's text)."""
        status: dict = {"value": self.state.value}
        if self.state is ModelState.FAILED:
            status["failed"] = True
        if self.error is not None:
            status["error"] = self.error
        return status
