"""LoRARegistry: the adapters a frontend serves by name, and the check every adapter passes.

An adapter is checked (services/common/lora_adapter.py) against the engine's limits and the
base model's linears before any request uses it, so a bad one is refused with its reason
and nothing else changes; the check stamps the digest of its files into the LoRARequest
(part of its identity). Named adapters (`--lora-modules`, /v1/load_lora_adapter) get ids of
their own: a reload under a name is a new identity.
"""

from __future__ import annotations

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
        self._checked: dict[tuple, LoRARequest] = {}
        # Ids for named adapters, far from the small ids LLM users pick by hand.
        self._ids = itertools.count(1 << 32)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def check(self, lora: LoRARequest) -> LoRARequest:
        """`lora` with its digest; LoRAAdapterError (a ValueError) names what is wrong."""
        if self.config is None:
            raise LoRAAdapterError(
                f"the request asks for the LoRA adapter {lora.lora_name!r}, but LoRA is not "
                "enabled: start the engine with --enable-lora."
            )
        key = (lora.lora_name, lora.lora_int_id, lora.lora_path, _files_stamp(lora.lora_path))
        checked = self._checked.get(key)
        if checked is None:
            spec = inspect_adapter(lora.lora_path, self.config, self.targets)
            checked = dataclasses.replace(lora, digest=spec.digest)
            if len(self._checked) >= _MAX_CHECKED:
                self._checked.pop(next(iter(self._checked)))
            self._checked[key] = checked
        return checked

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the adapter at `path` as `name` (a name in use is refused)."""
        if name in self.adapters:
            raise LoRAAdapterError(
                f"a LoRA adapter named {name!r} is already loaded; unload it first."
            )
        lora = self.check(LoRARequest(name, next(self._ids), path, base_model_name))
        self.adapters[name] = lora
        return lora

    def unload(self, name: str) -> LoRARequest:
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise LoRAAdapterError(f"no LoRA adapter named {name!r} is loaded.")
        return lora

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)


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
