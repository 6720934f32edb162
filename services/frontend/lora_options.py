"""LoRAServerOptions: the server's adapters (--lora-modules) and whether clients may load
and unload adapters while it runs (--enable-lora-runtime-updates), from where
(--lora-root, required with it: without it any file of the machine could be named) and how
many (--max-runtime-loras)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.common.flags import flag


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True)
class LoRAServerOptions:
    lora_modules: tuple[str, ...] = flag(
        (),
        "LoRA adapters served by name (needs --enable-lora): name=path, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; clients pass the name '
        "as the request's model",
    )
    enable_lora_runtime_updates: bool = flag(
        False,
        "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter for adapters under "
        "--lora-root (the --lora-modules adapters stay: clients cannot replace or unload them)",
    )
    lora_root: str | None = flag(
        None,
        "the directory clients may load LoRA adapters from (needed by "
        "--enable-lora-runtime-updates): a path must resolve inside it, symlinks followed",
    )
    max_runtime_loras: int = flag(
        64, "LoRA adapters loaded by clients served at once (--enable-lora-runtime-updates)"
    )

    def __post_init__(self) -> None:
        self.modules()  # a malformed entry fails at startup, by name
        if self.enable_lora_runtime_updates and not self.lora_root:
            raise ValueError(
                "--enable-lora-runtime-updates needs --lora-root DIR: the directory clients "
                "may load adapters from (without it they could name any file of this machine)."
            )
        if not isinstance(self.max_runtime_loras, int) or self.max_runtime_loras < 1:
            raise ValueError(f"--max-runtime-loras must be >= 1, got {self.max_runtime_loras!r}.")

    def modules(self) -> list[LoRAModule]:
        return [parse_lora_module(entry) for entry in self.lora_modules]


def parse_lora_module(entry: str) -> LoRAModule:
    """`name=path` or vLLM's JSON form."""
    text = entry.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {entry!r}: not valid JSON ({exc}).") from exc
        unknown = sorted(set(data) - {"name", "path", "base_model_name"})
        if unknown or not data.get("name") or not data.get("path"):
            extra = f"; unknown keys: {', '.join(unknown)}" if unknown else ""
            raise ValueError(
                f'--lora-modules {entry!r}: give "name" and "path" (and optionally '
                f'"base_model_name"){extra}.'
            )
        return LoRAModule(str(data["name"]), str(data["path"]), data.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {entry!r}: expected name=path.")
    return LoRAModule(name, path)
