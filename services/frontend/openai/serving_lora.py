"""The LoRA routes' logic: adapters as models (/v1/models), and loading / unloading them
at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter) when the server allows it.

A client's path must resolve inside --lora-root (lora_root.py), and every refused path
gets the one answer REFUSED_PATH, whatever the reason (missing, outside the root, not a
folder, unreadable, not an adapter this model serves): a different answer per reason
would tell a client what exists on the server's disks. The reason goes to the server
log. The operator's adapters (--lora-modules) are neither replaced nor unloaded by
clients, and no card shows a path.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.exceptions import HTTPException

from services.common.lora_request import LoRARequest
from services.frontend.lora_options import LoRAServerOptions
from services.frontend.lora_root import LoRARoot
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from services.frontend.openai.replies import ModelCard

logger = logging.getLogger(__name__)

# A name is an id in /v1/models, a label in /metrics and a word in the logs.
MAX_NAME_CHARS = 256

REFUSED_PATH = (
    "lora_path does not name a LoRA adapter this server can load: it must be an adapter "
    "folder under the server's --lora-root that fits the model (the server log says why)."
)


class OpenAIServingLoRA:
    def __init__(
        self, frontend, served_model_names: list[str], options: LoRAServerOptions | None = None
    ) -> None:
        """`options`: --enable-lora-runtime-updates and --lora-root (None: the defaults,
        runtime updates off); a --lora-root that is not a directory raises ValueError."""
        options = options or LoRAServerOptions()
        self.frontend = frontend
        self.served_model_names = served_model_names
        self.runtime_updates = options.enable_lora_runtime_updates
        self.max_runtime_loras = options.max_runtime_loras
        self.root = LoRARoot(options.lora_root) if options.lora_root else None

    @property
    def registry(self):
        return self.frontend.input_processor.loras

    def cards(self) -> list[ModelCard]:
        return [self.card(lora) for lora in self.registry.adapters.values()]

    def card(self, lora: LoRARequest) -> ModelCard:
        """An adapter: its parent is the base model it runs over (no root: vLLM shows the
        adapter's path there, which is the server's business, not its clients')."""
        return ModelCard(
            id=lora.lora_name,
            parent=lora.base_model_name or self.served_model_names[0],
            max_model_len=self.frontend.info.max_model_len,
        )

    async def load(self, request: LoadLoRAAdapterRequest) -> str:
        """Serve a new adapter (load_inplace: replace the client adapter of that name; a
        bad replacement leaves the old one served)."""
        registry = self._runtime_registry()
        name = request.lora_name
        self._check_loadable(name, request.load_inplace)
        try:
            folder = await asyncio.to_thread(self.root.resolve, request.lora_path)
            lora = await registry.checked(name, folder)
        except (ValueError, OSError) as exc:
            logger.warning("refused LoRA adapter %r at %r: %s", name, request.lora_path, exc)
            raise InvalidRequestError(REFUSED_PATH, "lora_path") from exc
        self._check_loadable(name, request.load_inplace)  # another load may have won meanwhile
        registry.serve(lora)
        logger.info("serving LoRA adapter %s (%s), loaded by a client", name, folder)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, request: UnloadLoRAAdapterRequest) -> str:
        registry = self._runtime_registry()
        name = request.lora_name
        if name in registry.operator:
            raise InvalidRequestError(_operator_adapter(name, "unload"), "lora_name")
        if registry.get(name) is None:
            raise HTTPException(404, f"no LoRA adapter named {name!r} is loaded.")
        registry.unload(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _check_loadable(self, name: str, inplace: bool) -> None:
        if not name or len(name) > MAX_NAME_CHARS or name in self.served_model_names:
            shown = name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..."
            raise InvalidRequestError(
                f"{shown!r} cannot name an adapter (a name of 1 to {MAX_NAME_CHARS} characters "
                "that is not the base model's).",
                "lora_name",
            )
        registry = self.registry
        if name in registry.operator:
            raise InvalidRequestError(_operator_adapter(name, "replace"), "lora_name")
        if registry.get(name) is not None:
            if inplace:
                return
            raise InvalidRequestError(
                f"a LoRA adapter named {name!r} is already loaded; unload it first "
                "(or pass load_inplace).",
                "lora_name",
            )
        if len(registry.adapters) - len(registry.operator) >= self.max_runtime_loras:
            raise InvalidRequestError(
                f"{self.max_runtime_loras} LoRA adapters loaded by clients are served already "
                "(--max-runtime-loras); unload one first.",
                "lora_name",
            )

    def _runtime_registry(self):
        if not self.runtime_updates:
            raise HTTPException(
                404,
                "loading and unloading LoRA adapters at run time is off: start the server "
                "with --enable-lora-runtime-updates and --lora-root.",
            )
        if not self.registry.enabled:
            raise InvalidRequestError(
                "LoRA is not enabled: start the engine with --enable-lora.", "lora_name"
            )
        return self.registry


def _operator_adapter(name: str, action: str) -> str:
    return (
        f"the LoRA adapter {name!r} is the server's own (--lora-modules); clients cannot "
        f"{action} it."
    )
