"""ModelsConfig: `serve`'s flags for many models (the registry's limits and its sources)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import parse_size
from services.common.flags import flag

MAX_MODELS = 256  # entries a models directory and a preset may name together


@dataclass(frozen=True)
class ModelsConfig:
    models_dir: str | None = flag(
        None,
        "serve every model in this directory, loaded on first use: each HF folder (with "
        "config.json) and each .gguf file, named by folder name / file stem (an mmproj-*.gguf "
        "is the projector of the GGUF beside it); a request's `model` picks one",
    )
    models_preset: str | None = flag(
        None,
        "a TOML or JSON file: one table per model name with its engine flags (dtype, "
        "max_model_len, quantization, ...; `model` = its path, `pinned` = loaded at start and "
        "never unloaded), over serve's own engine flags and --models-dir's entries",
    )
    models_max: int = flag(4, "--models-dir/--models-preset: models loaded at once (0: no bound)")
    idle_unload_seconds: float = flag(
        0.0,
        "--models-dir/--models-preset: unload a model idle this long (0: never; a request's "
        "keep_alive overrides it, as Ollama's)",
    )
    models_memory: int | str | None = flag(
        None,
        "--models-dir/--models-preset: memory the loaded models may use, e.g. 24GiB (default: "
        "the machine's MemAvailable at each load); a model's weights plus its KV cache must fit",
    )

    @property
    def enabled(self) -> bool:
        return self.models_dir is not None or self.models_preset is not None

    def memory_bytes(self) -> int | None:
        if self.models_memory is None:
            return None
        return parse_size(self.models_memory, "models_memory")

    def check(self) -> None:
        """ValueError naming the flag at fault."""
        if self.models_max < 0:
            raise ValueError(f"--models-max must be >= 0, got {self.models_max}.")
        if not self.idle_unload_seconds >= 0:  # NaN too
            raise ValueError(f"--idle-unload-seconds must be >= 0, got {self.idle_unload_seconds}.")
        memory = self.memory_bytes()
        if memory is not None and memory <= 0:
            raise ValueError(f"--models-memory must be > 0 bytes, got {self.models_memory}.")
