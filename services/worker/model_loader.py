"""Build the worker's model from a ModelConfig: resolve the name, pick the class, plan how
it runs (`plan_forward`), build it in that form, load and finish its weights.

Native architectures (registry.py) are filled straight from the safetensors files or a GGUF
file's tensors (kept quantized with `quantization` "gguf"); any other causal LM runs through
transformers (`HFFallbackForCausalLM`). dtype "auto" is bfloat16 on CUDA and on CPUs with
native bf16 (avx512_bf16 or AMX), float32 on other CPUs ($PAGESTREAM_CPU_DTYPE overrides).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from services.common.config import ModelConfig
from services.common.gguf_conversion import (
    GGUF_NATIVE_ARCHITECTURES,
    TEXT_GGUF_FILE,
    gguf_architecture,
    text_gguf_of,
)
from services.common.model_errors import ModelLoadError
from services.common.model_source import gguf_source, resolve_model
from services.common.pooler_config import PoolerConfig, sentence_transformers_pipeline
from services.common.rank_info import RankInfo
from services.worker.cpu_tuning import return_freed_memory
from services.worker.layers.attention import AttentionOps, resolve_attention_backend
from services.worker.layers.fused_moe import FusedMoE
from services.worker.layers.quantization.loading import ONLINE_METHODS, OnlineQuantization
from services.worker.layers.quantization.model_weights import (
    bytes_by_format,
    finish_loading,
    prepare_for_torch,
    quantization_name,
    resident_weight_bytes,
    set_online_quantization,
    weight_formats,
)
from services.worker.models.causal_lm import CausalLM, normalize_token_ids
from services.worker.models.forward_plan import ForwardPlan
from services.worker.models.gguf_weights import iterate_gguf_weights
from services.worker.models.llama import LlamaForCausalLM, stage_layers
from services.worker.models.registry import native_families, native_model_class
from services.worker.models.st_dense import load_dense_layers
from services.worker.models.weight_utils import iterate_weights
from services.worker.native_step import step_unsupported
from services.worker.pooler import read_hf_config, resolve_runner

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "load",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "resolve_model",
]

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
    """bfloat16 on CPUs with native bf16 matmuls (faster there, as vLLM's CPU backend picks),
    else float32; float32 residuals and norms (models/llama.py) keep bfloat16's greedy
    outputs close to float32's."""
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


def _check_fallback(config: PretrainedConfig, rank: RankInfo, quantization: str | None) -> None:
    if quantization is not None:
        names = ", ".join(getattr(config, "architectures", None) or ["unknown"])
        raise ModelLoadError(
            f"{names} runs through the transformers fallback, which takes float weights only; "
            f"quantization {quantization!r} needs a native model ({native_families()}). "
            "Pass --quantization none (a .gguf file is then de-quantized)."
        )
    if rank.world_size > 1:
        names = ", ".join(getattr(config, "architectures", None) or ["unknown"])
        raise ValueError(
            f"{names} runs through the transformers fallback, which supports only "
            "--tensor-parallel-size 1 and --pipeline-parallel-size 1 (tensor and pipeline "
            f"parallelism need a native model: {native_families()})."
        )


def resolve_quantization(
    model_config: ModelConfig, gguf: Path | None, native: bool = True
) -> str | None:
    """The quantization that runs: "gguf", "int8", "int4" or None (float weights). Unset,
    a .gguf model of the native family at dtype auto keeps its blocks; an explicit dtype
    (or an architecture only transformers runs) de-quantizes it."""
    requested = model_config.quantization
    if requested is None:
        keep = gguf is not None and native and model_config.dtype == "auto"
        return "gguf" if keep else None
    if requested == "none":
        return None
    if requested == "gguf" and gguf is None:
        raise ModelLoadError(
            f"quantization 'gguf' needs a .gguf model; {model_config.model} is an HF folder "
            "(int8 / int4 quantize a float checkpoint)."
        )
    return requested


def _native_gguf(model: str, folder: Path) -> Path | None:
    """The GGUF file whose tensors the native models read (None: an HF folder, or a file
    whose converted folder holds the weights: an encoder's, services/common/gguf_encoders);
    for llama.cpp's pair, the text GGUF its VLM folder leaves the text weights in."""
    gguf = gguf_source(model)
    if gguf is None:
        return text_gguf_of(folder)
    if gguf_architecture(gguf) not in GGUF_NATIVE_ARCHITECTURES:
        return None
    return gguf


def _checkpoint(folder: Path, gguf: Path | None, quantization: str | None, model, config):
    """The model's checkpoint tensors: a GGUF file's (quantized blocks kept for "gguf"),
    the folder's safetensors, or for llama.cpp's pair both (the text model's from its GGUF,
    the vision encoder's and projector's from the folder)."""
    if gguf is None:
        return iterate_weights(folder, model.owns_weight)
    keep = quantization == "gguf"
    text = iterate_gguf_weights(gguf, config.get_text_config(), keep, model.owns_weight)
    if not (folder / TEXT_GGUF_FILE).is_file():
        return text
    return itertools.chain(text, iterate_weights(folder, model.owns_weight))


def load_model(
    model_config: ModelConfig,
    device: torch.device | str | None = None,
    rank: RankInfo | None = None,
) -> CausalLM:
    """Load `model_config.model` for inference (eval mode, no grad needed).

    `device` (default: model_config.device) is where this rank runs (a worker picks its
    CUDA device by its local rank); the dtype is model_config.dtype's; `rank` says which
    tensor/pipeline shard this worker holds (only its own tensors are read). Raises
    ModelLoadError for a missing, corrupt or unsupported model, ValueError for a model
    that cannot be split as asked.
    """
    return load(model_config, device, rank).model


@dataclass(frozen=True)
class LoadedModel:
    """What a load produced: the model, and the facts the worker reports about it."""

    model: CausalLM
    quantization: str  # the quantized formats in use ("Q4_K+Q6_K", "int8") or "none"
    weight_bytes: int  # resident bytes of every weight (packed copies included)
    pooler: PoolerConfig | None  # the pooling runner's pooler, every field set; None: generates
    # what the pooled vector goes through: a cross-encoder's classifier or the folder's
    # Dense layers ([P, hidden] -> [P, out]); None: nothing
    head: object = None


def load(
    model_config: ModelConfig,
    device: torch.device | str | None = None,
    rank: RankInfo | None = None,
) -> LoadedModel:
    """load_model's model and what the worker reports of it, as one value."""
    with _no_cyclic_gc():
        loaded = _load_model(model_config, device, rank or RankInfo())
    return_freed_memory()
    return loaded


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Python's cycle collector paused while a model loads: loading allocates hundreds of
    thousands of short-lived objects (tensors, arrays, dataclasses) and none of them form
    cycles, so its passes were pure cost (15 % of a 1.5B model's load, measured with py-spy)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _use_triton_experts(model: nn.Module) -> None:
    """Mixtures of experts with float weights run their experts through the Triton kernels."""
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    stacked = sum(moe.use_triton() for moe in moes)
    if moes:
        logger.info("mixture of experts: %d of %d layers on the Triton kernels", stacked, len(moes))


def plan_forward(
    model_class: type[CausalLM] | None,
    config: PretrainedConfig,
    model_config: ModelConfig,
    pooling: bool,
    attention_ops: AttentionOps,
    dtype: torch.dtype,
    rank: RankInfo,
) -> ForwardPlan:
    """How the model runs (logged), decided here once before it is built: its attention
    as the class reads the checkpoint, and the native CPU step for its decoder wherever
    `_torch_decoder_reason` finds nothing against it."""
    bidirectional = model_class is not None and model_class.reads_bidirectionally(config, pooling)
    reason = _torch_decoder_reason(
        model_class, config, model_config, bidirectional, attention_ops, dtype, rank
    )
    plan = ForwardPlan(
        decoder="torch" if reason else "native",
        attention="bidirectional" if bidirectional else "causal",
        # the Triton backend's device runs the experts on its kernels too
        triton_experts=attention_ops.name == "triton",
        reason=reason or "the native CPU step runs this decoder",
    )
    logger.info(
        "forward plan: %s decoder (%s), %s attention", plan.decoder, plan.reason, plan.attention
    )
    return plan


def _torch_decoder_reason(
    model_class: type[CausalLM] | None,
    config: PretrainedConfig,
    model_config: ModelConfig,
    bidirectional: bool,
    attention_ops: AttentionOps,
    dtype: torch.dtype,
    rank: RankInfo,
) -> str | None:
    """Why the decoder runs its torch modules rather than the native CPU step, or None.

    The native step is the Llama family's CPU path: it runs the whole stack, attention
    included, in C++, causally over the paged cache, so it needs the C++ CPU attention
    backend (any other was asked for by name, runs on another device, or the extension did
    not build here) and causal attention; --enforce-eager keeps the torch modules (the
    reference); and the C++ stack must hold every layer of the stage at this dtype
    (services/worker/native_step.py `step_unsupported`)."""
    if model_class is None or not issubclass(model_class, LlamaForCausalLM):
        return "not a decoder of the Llama family"
    if bidirectional:
        return "bidirectional attention (the native step attends causally over the cache)"
    if model_config.enforce_eager:
        return "--enforce-eager"
    if attention_ops.name != "cpu":
        return f"the {attention_ops.name} attention backend (the native step's is cpu)"
    spec = model_class.describe(config)
    layers = stage_layers(spec.num_layers, rank.pipeline_parallel_size, rank.pp_rank)
    return step_unsupported(spec, layers, rank.tensor_parallel_size, dtype)


def _construct(
    model_class: type[CausalLM],
    config: PretrainedConfig,
    model_config: ModelConfig,
    rank: RankInfo,
    plan: ForwardPlan,
    pooling: bool,
    folder: Path,
) -> CausalLM:
    """The native model in the plan's final form, its weights not loaded yet (on the
    current default device and dtype)."""
    if getattr(model_class, "reads_pairs", False) and getattr(config, "sep_token_id", None) is None:
        config.sep_token_id = _sep_token_id(folder)  # where a pair's second text starts
    # the decoders are built in the plan's form; an encoder has one form
    formed = {"plan": plan} if issubclass(model_class, LlamaForCausalLM) else {}
    return model_class(  # type: ignore[call-arg]
        config,
        rank,
        pooling=pooling,
        expert_parallel=model_config.enable_expert_parallel,
        **formed,
    )


def _build_final_form(model: CausalLM, plan: ForwardPlan, dtype: torch.dtype) -> None:
    """The loader's build step, once the weights are loaded and finished: the form the
    plan's decoder runs (packed into the native step, or the torch modules' form)."""
    if plan.native:
        model.build_native_step()  # type: ignore[attr-defined]
        return
    prepare_for_torch(model, dtype)
    if plan.triton_experts:
        _use_triton_experts(model)


def _load_model(model_config: ModelConfig, device, rank: RankInfo) -> LoadedModel:
    start = time.perf_counter()
    folder = resolve_model(model_config.model)
    config = load_config(folder)
    target = resolve_device(device if device is not None else model_config.device)
    torch_dtype = resolve_dtype(model_config.dtype, target)
    attention_ops = resolve_attention_backend(model_config.attention_backend, target)
    model_class = native_model_class(getattr(config, "architectures", None))
    hf_config = read_hf_config(folder)
    pooling = resolve_runner(model_config.runner, folder, hf_config) == "pooling"
    plan = plan_forward(
        model_class, config, model_config, pooling, attention_ops, torch_dtype, rank
    )
    gguf = _native_gguf(model_config.model, folder)
    quantization = resolve_quantization(model_config, gguf, model_class is not None)
    if model_class is None:
        model = _fallback(config, rank, quantization, folder, target, torch_dtype)
        formats = weight_formats(model)
    else:
        with _default_dtype(torch_dtype), target:
            model = _construct(model_class, config, model_config, rank, plan, pooling, folder)
        if quantization in ONLINE_METHODS:
            online = OnlineQuantization(quantization, model_config.quantization_group_size)
            set_online_quantization(model, online)
        model.load_weights(_checkpoint(folder, gguf, quantization, model, config))  # type: ignore[attr-defined]
        _finish_loading(model)
        formats = weight_formats(model)  # as loaded (the torch modules' form de-quantizes)
        _build_final_form(model, plan, torch_dtype)
        model.to(target).eval()
    model.eos_token_ids = read_eos_token_ids(folder, config)
    pooler, head = (
        _pooler(model, model_config, folder, hf_config, config) if pooling else (None, None)
    )
    model.set_attention_ops(attention_ops)
    loaded = LoadedModel(
        model, quantization_name(formats), resident_weight_bytes(model), pooler, head
    )
    logger.info(
        "loaded %s (%s%s) on %s as %s, %s attention, in %.2f s; weights: %s; %.1f MB "
        "resident (linears: %s)",
        gguf or folder,
        type(model).__name__,
        f", pooling {pooler.pooling_type}" if pooler else "",
        target,
        torch_dtype,
        attention_ops.name,
        time.perf_counter() - start,
        ", ".join(f"{kind} {held}" for kind, held in formats.items()),
        loaded.weight_bytes / 1e6,
        ", ".join(f"{name} {held / 1e6:.1f} MB" for name, held in bytes_by_format(model).items()),
    )
    return loaded


def _fallback(config, rank, quantization, folder, target, dtype) -> CausalLM:
    """The transformers fallback's model (any causal LM without a native class)."""
    _check_fallback(config, rank, quantization)
    # imported here: transformers' modeling code costs ~1 s to import on 2 cores
    from services.worker.models.hf_fallback import HFFallbackForCausalLM

    return HFFallbackForCausalLM.from_pretrained(folder, target, dtype)


def _pooler(model, model_config: ModelConfig, folder: Path, hf_config: dict, config):
    """The pooling runner's PoolerConfig (every field set) and the head the pooled vector
    goes through (a cross-encoder's classifier, a folder's Dense layers, or None)."""
    pooler = model_config.pooler.resolve(folder, hf_config)
    pipeline = sentence_transformers_pipeline(folder)
    if not model.bidirectional and (
        pipeline.needs_whole_prompts or pooler.pooling_type in ("MAX", "WEIGHTED_MEAN")
    ):
        raise ModelLoadError(
            f"{folder}: {pooler.pooling_type} pooling and Dense modules run for encoders only "
            "(a decoder's prompt is pooled part by part, chunk by chunk)"
        )
    if not model.bidirectional:
        return pooler, None
    pooler = dataclasses.replace(pooler, whole_prompt=True)  # an encoder: prompts run whole
    model.max_seq_length = _max_seq_length(folder)
    if model.num_labels:  # a cross-encoder's logits
        classifier = pooler.for_classifier(
            model.num_labels,
            _score_activation(config),
            _label_names(config, model.num_labels),
            model.classifier_pooling,
        )
        return classifier, model.pooled_head
    if not pipeline.dense_dirs:
        return pooler, None
    head = load_dense_layers(folder, pipeline.dense_dirs, model.dtype).to(model.device)
    out_features = head[-1][0].out_features
    return dataclasses.replace(pooler, hidden_size=out_features), head


def _max_seq_length(folder: Path) -> int | None:
    """sentence_bert_config.json's max_seq_length (None: the folder has none)."""
    try:
        value = json.loads((folder / "sentence_bert_config.json").read_text()).get("max_seq_length")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def _sep_token_id(folder: Path) -> int | None:
    """The folder's tokenizer's [SEP] id (None: it has none)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder)).sep_token_id
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the tokenizer of {folder}: {exc}") from exc


def _label_names(config: PretrainedConfig, num_labels: int) -> tuple[str, ...]:
    """The classifier's labels by id, from config.json's id2label."""
    names = {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
    return tuple(names.get(i, f"LABEL_{i}") for i in range(num_labels))


def _score_activation(config: PretrainedConfig) -> str:
    """What turns a cross-encoder's logit into its score, as sentence-transformers'
    CrossEncoder does: the config's activation_fn, else a sigmoid for one label."""
    saved = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn", "")
    name = str(saved).rsplit(".", 1)[-1].lower()
    if name in ("sigmoid", "identity"):
        return name
    if saved:
        raise ModelLoadError(f"the cross-encoder's activation_fn {saved!r} is not supported")
    return "sigmoid" if int(config.num_labels) == 1 else "identity"


def _finish_loading(model: CausalLM) -> None:
    try:
        finish_loading(model)
    except ValueError as exc:
        raise ModelLoadError(f"cannot load the quantized weights: {exc}") from exc
