"""LoRARegistry: the adapters a frontend serves by name, and the check every adapter passes.

An adapter is checked (services/common/lora_adapter.py) against the engine's limits and the
base model's linears before any request uses it, so a bad one is refused with its reason and
nothing else changes; the digest of its files is part of its identity, and a reload under a
name is a new one. The operator's adapters (`--lora-modules`) may be neither replaced nor
unloaded by clients. A client's adapter is checked off the event loop (`checked`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os

from services.common.lora_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoRAAdapterError,
    inspect_adapter,
)
from services.common.lora_config import LoRAConfig, LoRATargets
from services.common.lora_request import LoRARequest

# Checked adapters remembered, by (name, id, path, the files' sizes and times): LLM.generate
# passes the same LoRARequest with every call and its files are read once (again when they
# change: new weights under the same request get a new digest, hence a new identity).
_MAX_CHECKED = 1024


class LoRARegistry:
    def __init__(self, config: LoRAConfig | None, targets: LoRATargets | None) -> None:
        self.config = config  # None: LoRA is off
        self.targets = targets or LoRATargets()  # the base linears adapters may target
        self.adapters: dict[str, LoRARequest] = {}  # served by name
        self.operator: set[str] = set()  # the names of adapters from --lora-modules
        self._checked: dict[tuple, LoRARequest] = {}
        # Ids for named adapters, far from the small ids LLM users pick by hand.
        self._ids = itertools.count(1 << 32)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def check(self, lora: LoRARequest) -> LoRARequest:
        """`lora` with its digest; LoRAAdapterError (a ValueError) names what is wrong."""
        self._require_enabled(lora)
        key = _check_key(lora)
        checked = self._checked.get(key)
        if checked is None:
            checked = self._remember(key, _inspected(lora, self.config, self.targets))
        return checked

    async def checked(self, name: str, path: str) -> LoRARequest:
        """A new adapter `name` at `path` (a new id), checked in a thread, not yet served."""
        lora = LoRARequest(name, next(self._ids), path)
        self._require_enabled(lora)
        key, checked = await asyncio.to_thread(_keyed_inspection, lora, self.config, self.targets)
        return self._remember(key, checked)

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the operator's adapter at `path` as `name` (a name in use is refused)."""
        if name in self.adapters:
            raise LoRAAdapterError(
                f"a LoRA adapter named {name!r} is already loaded; unload it first."
            )
        lora = self.check(LoRARequest(name, next(self._ids), path, base_model_name))
        self.adapters[name] = lora
        self.operator.add(name)
        return lora

    def serve(self, lora: LoRARequest) -> None:
        """Serve a client's checked adapter under its name (replacing one of that name)."""
        self.adapters[lora.lora_name] = lora

    def unload(self, name: str) -> LoRARequest:
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise LoRAAdapterError(f"no LoRA adapter named {name!r} is loaded.")
        self.operator.discard(name)
        return lora

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def _require_enabled(self, lora: LoRARequest) -> None:
        if self.config is None:
            raise LoRAAdapterError(
                f"the request asks for the LoRA adapter {lora.lora_name!r}, but LoRA is not "
                "enabled: start the engine with --enable-lora."
            )

    def _remember(self, key: tuple, checked: LoRARequest) -> LoRARequest:
        if len(self._checked) >= _MAX_CHECKED:
            self._checked.pop(next(iter(self._checked)))
        self._checked[key] = checked
        return checked


def _check_key(lora: LoRARequest) -> tuple:
    return (lora.lora_name, lora.lora_int_id, lora.lora_path, _files_stamp(lora.lora_path))


def _keyed_inspection(lora: LoRARequest, config: LoRAConfig, targets: LoRATargets):
    """(its cache key, `lora` checked): the file system's part of `checked`, in one thread."""
    return _check_key(lora), _inspected(lora, config, targets)


def _inspected(lora: LoRARequest, config: LoRAConfig, targets: LoRATargets) -> LoRARequest:
    """`lora` with the digest of its checked files (touches no registry state: it runs in
    a thread for a client's adapter)."""
    spec = inspect_adapter(lora.lora_path, config, targets)
    return dataclasses.replace(lora, digest=spec.digest)


def _files_stamp(path: str) -> tuple:
    """(size, mtime_ns) of the adapter's files; () when they are missing (the check says)."""
    stamp = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            info = os.stat(os.path.join(path, name))
        except OSError:
            return ()
        stamp += [info.st_size, info.st_mtime_ns]
    return tuple(stamp)
