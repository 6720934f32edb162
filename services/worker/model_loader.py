"""Build the worker's model from a ModelConfig: resolve the name, pick the class, load weights.

    model = load_model(ModelConfig(model="/models/llama"), device="cpu", dtype="auto")

Native architectures (Llama, Mistral, Qwen2) are constructed directly on the target device
and filled straight from the safetensors files; any other causal LM goes through
transformers (`HFFallbackForCausalLM`). dtype "auto" is bfloat16 on CUDA and on CPUs with
native bf16 (avx512_bf16 or AMX), float32 on other CPUs ($PAGESTREAM_CPU_DTYPE overrides).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from services.common.config import ModelConfig
from services.common.model_source import resolve_model
from services.common.rank_info import RankInfo
from services.worker.layers.attention import resolve_attention_backend
from services.worker.layers.packed_weight import pack_linears
from services.worker.models.causal_lm import CausalLM, normalize_token_ids
from services.worker.models.errors import ModelLoadError
from services.worker.models.hf_fallback import HFFallbackForCausalLM
from services.worker.models.registry import native_model_class
from services.worker.models.weight_utils import iterate_weights

__all__ = ["ModelLoadError", "load_model", "resolve_device", "resolve_dtype", "resolve_model"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: torch.device | str | None) -> torch.device:
    """ "auto"/None -> cuda when available, else cpu."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# What dtype "auto" means on the CPU, when set: float32, bfloat16 or float16.
CPU_DTYPE_ENV = "PAGESTREAM_CPU_DTYPE"


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """ "auto"/None -> bfloat16 on CUDA; on the CPU bfloat16 where it computes bf16 natively
    (avx512_bf16 or AMX; $PAGESTREAM_CPU_DTYPE overrides), else float32. Names map to
    torch dtypes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else cpu_auto_dtype()
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}.")
    return _DTYPES[dtype]


def cpu_auto_dtype() -> torch.dtype:
    """bfloat16 on CPUs with native bf16 matmuls, as vLLM's CPU backend picks: measured on a
    2-core Zen 4 (avx512_bf16), SmolLM2-135M, the quick benchmark's 64 requests: 326 vs
    241 output tok/s (1.35x float32), with float32 residuals and norms (models/llama.py)
    keeping greedy outputs close to float32's."""
    name = os.environ.get(CPU_DTYPE_ENV, "").strip()
    if name:
        if name not in _DTYPES:
            raise ValueError(f"{CPU_DTYPE_ENV} must be one of {', '.join(_DTYPES)}; got {name!r}.")
        return _DTYPES[name]
    return torch.bfloat16 if native_bf16() else torch.float32


def native_bf16() -> bool:
    """The CPU has bf16 dot products (avx512_bf16) or AMX tiles."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_config(folder: Path) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {exc}") from exc


def read_eos_token_ids(folder: Path, config: PretrainedConfig) -> tuple[int, ...]:
    """eos ids from generation_config.json when present, else from config.json."""
    path = folder / "generation_config.json"
    if path.is_file():
        try:
            ids = normalize_token_ids(json.loads(path.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        if ids:
            return ids
    return normalize_token_ids(getattr(config.get_text_config(), "eos_token_id", None))


def _check_fallback_parallel(config: PretrainedConfig, rank: RankInfo) -> None:
    if rank.world_size > 1:
        names = ", ".join(getattr(config, "architectures", None) or ["unknown"])
        raise ValueError(
            f"{names} runs through the transformers fallback, which supports only "
            "--tensor-parallel-size 1 and --pipeline-parallel-size 1 (tensor and pipeline "
            "parallelism need a native model: Llama, Mistral, Qwen2)."
        )


def load_model(
    model_config: ModelConfig,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    rank: RankInfo | None = None,
) -> CausalLM:
    """Load `model_config.model` for inference (eval mode, no grad needed).

    device/dtype default to model_config.device/model_config.dtype; `rank` says which
    tensor/pipeline shard this worker holds (only its own tensors are read). Raises
    ModelLoadError for a missing, corrupt or unsupported model, ValueError for a model
    that cannot be split as asked.
    """
    rank = rank or RankInfo()
    start = time.perf_counter()
    folder = resolve_model(model_config.model)
    config = load_config(folder)
    target = resolve_device(device if device is not None else model_config.device)
    torch_dtype = resolve_dtype(dtype if dtype is not None else model_config.dtype, target)
    attention_ops = resolve_attention_backend(model_config.attention_backend, target)
    model_class = native_model_class(getattr(config, "architectures", None))
    if model_class is None:
        _check_fallback_parallel(config, rank)
        model: CausalLM = HFFallbackForCausalLM.from_pretrained(folder, target, torch_dtype)
    else:
        with _default_dtype(torch_dtype), target:
            model = model_class(config, rank)  # type: ignore[call-arg]
        weights = iterate_weights(folder, model.owns_weight)  # type: ignore[attr-defined]
        model.load_weights(weights)  # type: ignore[attr-defined]
        model.to(target).eval()
    model.eos_token_ids = read_eos_token_ids(folder, config)
    model.set_attention_ops(attention_ops)
    # a native model runs the C++ step on the CPU where it applies, else packed linears
    cpu_step = attention_ops.name == "cpu" and model_class is not None
    if model_class is not None and not (cpu_step and model.use_native_step()):  # type: ignore[attr-defined]
        pack_linears(model)
    logger.info(
        "loaded %s (%s) on %s as %s, %s attention, in %.2f s",
        folder,
        type(model).__name__,
        target,
        torch_dtype,
        model.attention_ops.name,
        time.perf_counter() - start,
    )
    return model
