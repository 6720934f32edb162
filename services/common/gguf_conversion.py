"""Convert a GGUF file once into a cached HF folder (config, tokenizer, and for some models
the weights).

The folder always holds config.json, generation_config.json and the tokenizer files (with
the chat template): every role reads those. The weights of the native family's
architectures (GGUF_NATIVE_ARCHITECTURES) are not written: the worker reads them from the
GGUF file itself, kept quantized or de-quantized (services/worker/models/gguf_weights.py).
Other architectures run through transformers, so their weights are de-quantized into
model.safetensors (float32) here; that dequantization and the GGUF -> HF tensor naming are
transformers' own (`load_gguf_checkpoint`); transformers' `from_pretrained(gguf_file=...)`
is not used for the weights because it requires `accelerate`. The folder is written into a
temporary directory next to the target and renamed into place, so a crash never leaves a
half-written model and concurrent starts agree on one result. A marker file records the
source, so a changed GGUF file is converted again. torch, safetensors and transformers are
imported inside the functions that convert: importing this module (the frontend and the
scheduler do, through model_source.py) costs nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from services.common.model_errors import ModelLoadError

logger = logging.getLogger(__name__)

MARKER_FILE = "pagestream_conversion.json"
# GGUF architectures the native models load straight from the file (no weights written).
GGUF_NATIVE_ARCHITECTURES = ("llama", "qwen2", "mistral")
# Bumped when the folder's contents change (2: no weights for native architectures).
LAYOUT = 2


def _source_fingerprint(gguf_path: Path) -> dict[str, object]:
    return {
        "source_name": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
        "layout": LAYOUT,
    }


def is_converted(out_dir: Path, gguf_path: Path) -> bool:
    """True when `out_dir` holds a finished conversion of this GGUF file."""
    marker = out_dir / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    expected = _source_fingerprint(gguf_path)
    return all(recorded.get(key) == value for key, value in expected.items())


def ensure_converted(gguf_path: Path, out_dir: Path) -> Path:
    """The HF folder converted from `gguf_path`, converting it first when needed."""
    if is_converted(out_dir, gguf_path):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    logger.info("converting %s into %s (once)", gguf_path, out_dir)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write_hf_folder(gguf_path, tmp_dir)
        (tmp_dir / MARKER_FILE).write_text(json.dumps(_source_fingerprint(gguf_path)))
        _make_readable(tmp_dir)
        _move_into_place(tmp_dir, out_dir, gguf_path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return out_dir


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a private (0700) folder; a shared cache must be readable by all."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _move_into_place(tmp_dir: Path, out_dir: Path, gguf_path: Path) -> None:
    """Rename the finished folder to `out_dir`, replacing a stale conversion."""
    if out_dir.exists():
        if is_converted(out_dir, gguf_path):  # another process finished first
            return
        stale = out_dir.with_name(f".{out_dir.name}.stale-{os.getpid()}")
        out_dir.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp_dir.rename(out_dir)
    except OSError:
        if not is_converted(out_dir, gguf_path):
            raise


def gguf_architecture(gguf_path: Path) -> str:
    """The file's general.architecture ("llama", "qwen2", ...)."""
    from services.common.gguf_file import GGUFFile

    return GGUFFile(gguf_path).architecture


def write_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    """Write an HF folder for `gguf_path`: config.json, generation_config.json and the
    tokenizer files (with the chat template), and model.safetensors (float32, de-quantized)
    unless the architecture is one the native models read from the GGUF file."""
    try:
        with_weights = gguf_architecture(gguf_path) not in GGUF_NATIVE_ARCHITECTURES
        config, tensors = _read_gguf(gguf_path, with_weights)
        tokenizer = _read_tokenizer(gguf_path)
    except ModelLoadError:
        raise
    except Exception as exc:  # GGUF parsing raises many types; report one clear error
        raise ModelLoadError(
            f"could not read GGUF file {gguf_path} ({type(exc).__name__}: {exc}). It may be "
            "corrupt or truncated: fetch it again (for the default model: run `make setup`)."
        ) from exc
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    if with_weights:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _read_gguf(gguf_path: Path, with_weights: bool) -> tuple[object, dict]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with torch.device("meta"):  # only for the tensor-name mapping; no memory, no init
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    if not with_weights:
        return config, {}
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    expected = set(skeleton.state_dict())
    tensors = {
        name: tensor.to(torch.float32).contiguous()
        for name, tensor in parsed["tensors"].items()
        if name in expected
    }
    missing = expected - set(tensors)
    if getattr(config, "tie_word_embeddings", False):
        missing.discard("lm_head.weight")
    if missing:
        raise ModelLoadError(
            f"GGUF file {gguf_path} lacks tensors for {', '.join(sorted(missing)[:8])}."
        )
    return config, tensors


def _read_tokenizer(gguf_path: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
