"""sentence-transformers' Dense modules (`2_Dense/`, ...): a linear layer and its
activation after the pooling, as the folder saved them.

    head = load_dense_layers(folder, ("2_Dense",), torch.float32)  # [P, in] -> [P, out]

Each folder holds config.json (in_features, out_features, bias, activation_function) and
its weights (model.safetensors or pytorch_model.bin: linear.weight, linear.bias).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from services.common.model_errors import ModelLoadError

_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": nn.Tanh,
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.ReLU": nn.ReLU,
    "torch.nn.modules.activation.GELU": nn.GELU,
    "torch.nn.modules.activation.Sigmoid": nn.Sigmoid,
}


def load_dense_layers(folder: Path, dirs: Sequence[str], dtype: torch.dtype) -> nn.Sequential:
    return nn.Sequential(*(_dense(folder / d, dtype) for d in dirs)).eval()


def _dense(path: Path, dtype: torch.dtype) -> nn.Sequential:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    activation = config.get("activation_function", "torch.nn.modules.linear.Identity")
    if activation not in _ACTIVATIONS:
        raise ModelLoadError(f"{path}: activation_function {activation!r} is not supported")
    linear = nn.Linear(config["in_features"], config["out_features"], config.get("bias", True))
    weights = _weights(path)
    try:
        linear.load_state_dict({k.removeprefix("linear."): v for k, v in weights.items()})
    except RuntimeError as exc:
        raise ModelLoadError(f"{path}: the weights do not fit its config: {exc}") from exc
    return nn.Sequential(linear, _ACTIVATIONS[activation]()).to(dtype)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ModelLoadError(f"{path} holds no weights (model.safetensors or pytorch_model.bin)")
