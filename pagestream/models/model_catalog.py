"""The models a multi-model serve knows: --models-dir's entries, --models-preset's tables
and serve's MODEL positional, each turned into a ModelSpec over serve's own engine flags.

A models directory holds, directly: HF folders (config.json), .gguf files (named by their
stem), and folders of one .gguf (plus at most one mmproj-*.gguf, its vision projector).
An mmproj-*.gguf beside the GGUF files is the projector of mmproj-STEM.gguf's STEM.gguf, or
of the only GGUF there. A preset table's keys are EngineArgs' flag names (dashes or
underscores) read by serve's own parser, plus `model` (its path, relative to the preset)
and `pinned`; a table named like a directory entry adjusts that entry.
"""

from __future__ import annotations

import argparse
import json
import logging
import tomllib
from pathlib import Path

from pagestream.engine_args import EngineArgs
from pagestream.models.model_spec import ModelSpec, check_model_name
from pagestream.models.models_config import MAX_MODELS, ModelsConfig
from services.common.flags import add_flags, flag_fields, from_flags

logger = logging.getLogger(__name__)

MAX_PRESET_BYTES = 1 << 20
_OWN_KEYS = ("model", "pinned")
_NOT_PER_MODEL = ("served_model_name",)  # a preset entry's name is its served name


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


def build_specs(ns: argparse.Namespace, config: ModelsConfig) -> list[ModelSpec]:
    """Every model, the default first: MODEL when given (pinned), else the preset's first
    table, else the directory's first entry by name. ValueError names what is wrong."""
    found = scan_models_dir(Path(config.models_dir)) if config.models_dir else {}
    preset = read_preset(Path(config.models_preset)) if config.models_preset else {}
    # name -> {model, mmproj, flags...}: a preset table over the directory entry of its name
    sources = {name: {**found.get(name, {}), **entry} for name, entry in preset.items()}
    for name, entry in found.items():
        sources.setdefault(name, entry)
    if ns.model is not None:
        name = check_model_name(ns.served_model_name or _stem(Path(ns.model)))
        sources.pop(name, None)  # MODEL stands for itself, whatever the directory holds
        sources = {name: {"model": ns.model, "pinned": True}, **sources}
    if not sources:
        raise ValueError("--models-dir / --models-preset name no models.")
    if len(sources) > MAX_MODELS:
        raise ValueError(f"{len(sources)} models: at most {MAX_MODELS} may be served at once.")
    return [_spec(name, entry, ns) for name, entry in sources.items()]


def scan_models_dir(folder: Path) -> dict[str, dict]:
    """name -> {"model": path[, "mmproj": path]} for each model directly in `folder`."""
    if not folder.is_dir():
        raise ValueError(f"--models-dir {folder}: not a directory.")
    found: dict[str, dict] = {}
    children = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    ggufs = [p for p in children if p.is_file() and p.suffix.lower() == ".gguf"]
    for child in children:
        entry = _dir_entry(child) if child.is_dir() else _file_entry(child, ggufs)
        if entry is None:
            continue
        name = _stem(child)
        try:
            check_model_name(name)
        except ValueError as exc:
            logger.warning("--models-dir: %s skipped: %s", child, exc)
            continue
        if name in found:
            both = f"{found[name]['model']}, {child}"
            raise ValueError(f"--models-dir: two models named {name!r} ({both}).")
        found[name] = entry
        if len(found) > MAX_MODELS:
            raise ValueError(f"--models-dir {folder}: more than {MAX_MODELS} models.")
    return found


def _stem(path: Path) -> str:
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def _is_mmproj(path: Path) -> bool:
    return path.name.lower().startswith("mmproj")


def _dir_entry(folder: Path) -> dict | None:
    if (folder / "config.json").is_file():
        return {"model": str(folder)}
    ggufs = sorted(folder.glob("*.gguf"))
    models = [p for p in ggufs if not _is_mmproj(p)]
    projectors = [p for p in ggufs if _is_mmproj(p)]
    if len(models) == 1 and len(projectors) <= 1:
        return {"model": str(models[0]), **({"mmproj": str(projectors[0])} if projectors else {})}
    if ggufs:
        logger.warning("--models-dir: %s skipped: not one model GGUF (+ one mmproj)", folder)
    return None


def _file_entry(path: Path, ggufs: list[Path]) -> dict | None:
    if path.suffix.lower() != ".gguf" or _is_mmproj(path):
        return None
    projectors = [p for p in ggufs if _is_mmproj(p)]
    models = [p for p in ggufs if not _is_mmproj(p)]
    named = [p for p in projectors if p.stem.lower() == f"mmproj-{path.stem}".lower()]
    if named:
        return {"model": str(path), "mmproj": str(named[0])}
    if len(models) == 1 and len(projectors) == 1:
        return {"model": str(path), "mmproj": str(projectors[0])}
    return {"model": str(path)}


def read_preset(path: Path) -> dict[str, dict]:
    """name -> entry, from a .toml or .json file of one table per model."""
    if not path.is_file():
        raise ValueError(f"--models-preset {path}: no such file.")
    if path.stat().st_size > MAX_PRESET_BYTES:
        raise ValueError(f"--models-preset {path}: over {MAX_PRESET_BYTES} bytes.")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--models-preset {path}: {exc}") from exc
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"--models-preset {path}: one table (object) per model name.")
    preset = {}
    for name, entry in data.items():
        check_model_name(name)
        entry = dict(entry)
        for key in ("model", "mmproj"):
            if isinstance(entry.get(key), str):  # relative to the preset file
                entry[key] = str(path.parent / Path(entry[key]).expanduser())
        preset[name] = entry
    return preset


def _spec(name: str, entry: dict, ns: argparse.Namespace) -> ModelSpec:
    if "model" not in entry:
        raise ValueError(f"model {name!r}: no `model` path, and no --models-dir entry so named.")
    flags = {key.replace("-", "_"): value for key, value in entry.items()}
    pinned = flags.pop("pinned", False)
    if not isinstance(pinned, bool):
        raise ValueError(f"model {name!r}: pinned must be true or false.")
    model, mmproj = str(flags.pop("model")), flags.pop("mmproj", None)
    try:
        merged = _parse_flags(flags, ns)
        args = from_flags(EngineArgs, merged, model=model, served_model_name=name, mmproj=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"model {name!r}: {exc}") from exc
    return ModelSpec(name, args, pinned, None if mmproj is None else str(mmproj))


def _parse_flags(flags: dict, ns: argparse.Namespace) -> argparse.Namespace:
    """serve's namespace with this entry's flags read over it by EngineArgs' own parser
    (the same types, choices and messages as on the command line)."""
    known = {field.name for field, _ in flag_fields(EngineArgs)} - set(_NOT_PER_MODEL)
    unknown = sorted(set(flags) - known - set(_OWN_KEYS))
    if unknown:
        raise ValueError(f"unknown keys {', '.join(unknown)} (engine flags, model, pinned).")
    parser = _RaisingParser(add_help=False)
    add_flags(parser, EngineArgs)
    argv: list[str] = []
    for key, value in flags.items():
        argv += _argv(key, value)
    return parser.parse_args(argv, namespace=argparse.Namespace(**vars(ns)))


def _argv(key: str, value) -> list[str]:
    field_spec = {f.name: spec for f, spec in flag_fields(EngineArgs)}[key]
    name = field_spec.flag_name(key)
    if value is None:
        return []
    if isinstance(value, bool):
        return [name if value else "--no-" + name[2:]]
    if isinstance(value, list | tuple):
        return [name, *map(str, value)]
    if isinstance(value, dict):
        return [name, json.dumps(value)]
    return [name, str(value)]
