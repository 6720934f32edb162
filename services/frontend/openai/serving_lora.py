"""The LoRA routes' logic: adapters as models (/v1/models), and loading / unloading them
at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter) when the server allows it."""

from __future__ import annotations

from starlette.exceptions import HTTPException

from services.common.lora_request import LoRARequest
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from services.frontend.openai.replies import ModelCard


class OpenAIServingLoRA:
    def __init__(self, frontend, served_model_names: list[str], runtime_updates: bool) -> None:
        self.frontend = frontend
        self.served_model_names = served_model_names
        self.runtime_updates = runtime_updates

    @property
    def registry(self):
        return self.frontend.input_processor.loras

    def cards(self) -> list[ModelCard]:
        return [self.card(lora) for lora in self.registry.adapters.values()]

    def card(self, lora: LoRARequest) -> ModelCard:
        """An adapter: its parent is the base model it runs over."""
        return ModelCard(
            id=lora.lora_name,
            root=lora.lora_path,
            parent=lora.base_model_name or self.served_model_names[0],
            max_model_len=self.frontend.info.max_model_len,
        )

    def load(self, request: LoadLoRAAdapterRequest) -> str:
        """Serve a new adapter (load_inplace: replace the one of that name; a bad
        replacement leaves the old one served)."""
        registry = self._runtime_registry()
        name = request.lora_name
        if not name or name in self.served_model_names:
            raise InvalidRequestError(f"{name!r} cannot name an adapter.", "lora_name")
        old = registry.get(name) if request.load_inplace else None
        if old is not None:
            registry.unload(name)
        try:
            registry.load(name, request.lora_path)
        except ValueError as exc:
            if old is not None:
                registry.adapters[name] = old
            raise InvalidRequestError(str(exc), "lora_path") from exc
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, request: UnloadLoRAAdapterRequest) -> str:
        registry = self._runtime_registry()
        if registry.get(request.lora_name) is None:
            raise HTTPException(404, f"no LoRA adapter named {request.lora_name!r} is loaded.")
        registry.unload(request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    def _runtime_registry(self):
        if not self.runtime_updates:
            raise HTTPException(
                404,
                "loading and unloading LoRA adapters at run time is off: start the server "
                "with --enable-lora-runtime-updates.",
            )
        if not self.registry.enabled:
            raise InvalidRequestError(
                "LoRA is not enabled: start the engine with --enable-lora.", "lora_name"
            )
        return self.registry
