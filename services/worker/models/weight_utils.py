"""Reading checkpoint tensors from an HF folder's safetensors files (single or sharded)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from services.common.model_errors import ModelLoadError
from services.worker.models.load_progress import LoadProgress

if TYPE_CHECKING:  # torch is imported by safe_open(framework="pt") when weights are read
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of `folder`: the shards named by its index, else every *.safetensors."""
    index_path = folder / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(
                f"{index_path} is not a valid safetensors index ({exc}); "
                "re-save the model with save_pretrained()."
            ) from exc
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise ModelLoadError(
                f"{index_path} names shard(s) that are missing from {folder}: "
                f"{', '.join(missing)}. Copy the complete checkpoint folder."
            )
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"No *.safetensors weights in {folder} (only safetensors checkpoints are supported; "
            "convert .bin weights with save_pretrained(..., safe_serialization=True))."
        )
    return files


def iterate_weights(
    folder: Path, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every checkpoint tensor, on the CPU, one file at a time.

    `wanted(name)` False skips a tensor without reading it (another pipeline stage's).
    """
    files = safetensors_files(folder)
    progress = LoadProgress(folder.name, sum(path.stat().st_size for path in files))
    for path in files:
        logger.debug("reading %s", path)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                names = [n for n in handle.keys() if wanted is None or wanted(n)]  # noqa: SIM118
                for name in names:
                    tensor = handle.get_tensor(name)
                    yield name, tensor
                    progress.add(tensor.numel() * tensor.element_size())
        except SafetensorError as exc:
            raise ModelLoadError(
                f"Weights file {path} is corrupt or truncated ({exc}). Delete the model folder "
                "and convert or copy it again (for the default model: run `make setup`)."
            ) from exc
    progress.done()


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
) -> None:
    """Copy a checkpoint tensor into a parameter of the same shape (dtype/device converted)."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
            f"expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)
