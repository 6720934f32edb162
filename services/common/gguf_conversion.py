"""Convert a GGUF file once into a cached HF folder (config, tokenizer, and for some models
the weights).

Every role reads the folder's config.json, generation_config.json and tokenizer files; the
native families' weights stay in the GGUF file (services/worker/models/gguf_weights.py),
other architectures get a de-quantized model.safetensors (`write_hf_folder`). The folder is
written beside the target and renamed into place, so a crash never leaves half a model and
concurrent starts agree; a marker records the source, so a changed file converts again.
torch, safetensors and transformers load only when converting (the frontend imports this).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

from services.common.gguf_encoders import ENCODER_ARCHITECTURES, write_encoder_folder
from services.common.model_errors import ModelLoadError

logger = logging.getLogger(__name__)

MARKER_FILE = "pagestream_conversion.json"
# A pair's folder's record of the text GGUF its text weights stay in: {"path", "size"}.
TEXT_GGUF_FILE = "pagestream_text_gguf.json"
# GGUF architectures the native models load straight from the file (no weights written).
GGUF_NATIVE_ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma3",
    "phi3",
    "smollm3",
    "qwen2moe",
    "qwen3moe",
)
# Architectures transformers' GGUF reader does not know whose files are "llama" files in
# all but the name (llama.cpp's smollm3: the same tensors and keys, every 4th layer
# without rotary): read through a metadata-only "llama" twin of the file.
LLAMA_LIKE_ARCHITECTURES = ("smollm3",)
# Bumped when the folder's contents change (2: no weights for native architectures; 3: the
# head_dim of the file's key_length, native Qwen3, Llama 3.x's rotary scaling; 4: Gemma 3's
# attention scale and rotary scaling; 5: mixtures of experts: Qwen2-MoE / Qwen3-MoE's
# widths, Mixtral's config; 6: encoders, services/common/gguf_encoders.py).
LAYOUT = 6
# Bumped when a pair's folder changes (2: the native text model's weights stay in its GGUF).
PAIR_LAYOUT = 2


def _source_fingerprint(gguf_path: Path, mmproj: Path | None = None) -> dict[str, object]:
    fingerprint: dict[str, object] = {
        "source_name": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
        "layout": LAYOUT,
    }
    if mmproj is not None:  # a pair (services/common/gguf_vlm.py): both files name it
        fingerprint |= {
            "mmproj_name": mmproj.name,
            "mmproj_size": mmproj.stat().st_size,
            "pair_layout": PAIR_LAYOUT,
        }
    return fingerprint


def is_converted(out_dir: Path, gguf_path: Path, mmproj: Path | None = None) -> bool:
    """True when `out_dir` holds a finished conversion of this GGUF file (with `mmproj`:
    of the pair)."""
    marker = out_dir / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    expected = _source_fingerprint(gguf_path, mmproj)
    return all(recorded.get(key) == value for key, value in expected.items())


def text_gguf_of(folder: Path) -> Path | None:
    """The text GGUF whose weights a pair's VLM folder leaves in it (None: a folder that
    holds all its weights); a ModelLoadError when that file is gone or is no longer the
    one converted (its size, and the marker's name and size)."""
    record = folder / TEXT_GGUF_FILE
    if not record.is_file():
        return None
    try:
        entry = json.loads(record.read_text())
        path, size = Path(entry["path"]), int(entry["size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{record} cannot be read ({exc}): convert the pair again") from exc
    if not path.is_file() or path.stat().st_size != size or not is_converted(folder, path):
        raise ModelLoadError(
            f"{folder} reads its text model's weights from {path}, which is missing or has "
            "changed since the pair was converted: pass the text GGUF and --mmproj again"
        )
    return path


def ensure_converted(gguf_path: Path, out_dir: Path, mmproj: Path | None = None) -> Path:
    """The HF folder converted from `gguf_path` (and its vision projector file `mmproj`:
    a VLM folder), converting first when needed."""
    if is_converted(out_dir, gguf_path, mmproj):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    logger.info("converting %s into %s (once)", gguf_path, out_dir)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write_hf_folder(gguf_path, tmp_dir, mmproj)
        (tmp_dir / MARKER_FILE).write_text(json.dumps(_source_fingerprint(gguf_path, mmproj)))
        _make_readable(tmp_dir)
        _move_into_place(tmp_dir, out_dir, gguf_path, mmproj)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return out_dir


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a private (0700) folder; a shared cache must be readable by all."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _move_into_place(tmp_dir: Path, out_dir: Path, gguf_path: Path, mmproj: Path | None) -> None:
    """Rename the finished folder to `out_dir`, replacing a stale conversion."""
    if out_dir.exists():
        if is_converted(out_dir, gguf_path, mmproj):  # another process finished first
            return
        stale = out_dir.with_name(f".{out_dir.name}.stale-{os.getpid()}")
        out_dir.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp_dir.rename(out_dir)
    except OSError:
        if not is_converted(out_dir, gguf_path, mmproj):
            raise


_REFETCH = (
    "It may be corrupt or truncated: fetch it again (for the default model: run `make setup`)."
)


def gguf_architecture(gguf_path: Path) -> str:
    """The file's general.architecture ("llama", "qwen2", ...)."""
    from services.common.gguf_file import GGUFFile

    return GGUFFile(gguf_path).architecture


def write_hf_folder(gguf_path: Path, out_dir: Path, mmproj: Path | None = None) -> None:
    """Write an HF folder for `gguf_path`: config.json, generation_config.json and the
    tokenizer files (with the chat template), and model.safetensors (float32, de-quantized)
    unless the architecture is one the native models read from the GGUF file
    (GGUF_NATIVE_ARCHITECTURES). The de-quantization and the GGUF -> HF tensor names are
    transformers' own (`load_gguf_checkpoint`); `from_pretrained(gguf_file=...)` is not
    used for the weights because it requires `accelerate`. With a vision projector file
    `mmproj`, the pair's VLM folder (services/common/gguf_vlm.py): the vision weights
    written, the text weights as for the text GGUF alone."""
    from services.common.gguf_file import GGUFError

    try:
        arch = gguf_architecture(gguf_path)  # the file validated before any other reader
        if arch == "clip":
            raise ModelLoadError(
                f"{gguf_path} is llama.cpp's vision projector (mmproj) file: pass the text "
                "GGUF as the model and this file as --mmproj (LLM(..., mmproj=...))."
            )
        if arch in ENCODER_ARCHITECTURES and mmproj is None:
            write_encoder_folder(gguf_path, out_dir)
            return
        with_weights = arch not in GGUF_NATIVE_ARCHITECTURES
        config, tensors, tokenizer = _read_text_model(gguf_path, arch, out_dir, with_weights)
        if mmproj is not None:
            from services.common.gguf_vlm import write_vlm_folder

            write_vlm_folder(config, tensors, tokenizer, mmproj, out_dir)
            if not with_weights:  # the text model's stay in its GGUF
                record = {"path": str(gguf_path.resolve()), "size": gguf_path.stat().st_size}
                (out_dir / TEXT_GGUF_FILE).write_text(json.dumps(record))
            return
    except GGUFError as exc:  # its message names the file and the field; add the remedy
        raise GGUFError(f"{exc}. {_REFETCH}") from exc
    except ModelLoadError:
        raise
    except Exception as exc:  # GGUF parsing raises many types; report one clear error
        raise ModelLoadError(
            f"could not read GGUF file {gguf_path} ({type(exc).__name__}: {exc}). {_REFETCH}"
        ) from exc
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    if with_weights:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _read_text_model(gguf_path: Path, arch: str, out_dir: Path, with_weights: bool):
    """The text GGUF's HF config, float32 tensors (HF names; none unless `with_weights`)
    and tokenizer."""
    readable = _llama_twin(gguf_path, out_dir) if arch in LLAMA_LIKE_ARCHITECTURES else gguf_path
    config, tensors = _read_gguf(readable, with_weights)
    tokenizer = _read_tokenizer(readable)
    if arch == "smollm3":
        config = _smollm3_config(config, gguf_path)
    if readable != gguf_path:
        readable.unlink()
    return config, tensors, tokenizer


def _llama_twin(gguf_path: Path, out_dir: Path) -> Path:
    """A metadata-only copy of `gguf_path` (no tensors) whose architecture reads "llama",
    its `{arch}.*` keys renamed `llama.*`: what transformers' GGUF readers take."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    arch = gguf_architecture(gguf_path)  # validated first: GGUFReader trusts the header
    reader = GGUFReader(str(gguf_path))
    twin = out_dir / "llama-twin.gguf"
    writer = GGUFWriter(str(twin), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        name = (
            "llama." + field.name.removeprefix(arch + ".")
            if field.name.startswith(arch + ".")
            else field.name
        )
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return twin


def _smollm3_config(config: object, gguf_path: Path) -> object:
    """SmolLM3 from the twin's llama config: llama.cpp leaves rotary out of every 4th layer
    (its fixed `n_no_rope_layer_step`; the file says nothing more), and the embedding is
    tied when the file (not the tensorless twin) has no `output` tensor."""
    from transformers import SmolLM3Config

    from services.common.gguf_file import GGUFFile

    values = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    values["tie_word_embeddings"] = all(
        t.name != "output.weight" for t in GGUFFile(gguf_path).tensors
    )
    smollm3 = SmolLM3Config(**values, no_rope_layer_interval=4, no_rope_layers=None)
    smollm3.architectures = ["SmolLM3ForCausalLM"]
    return smollm3


def _read_gguf(gguf_path: Path, with_weights: bool) -> tuple[object, dict]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config = _fix_config(config, gguf_path)
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


def _fix_config(config: object, gguf_path: Path) -> object:
    """What transformers' GGUF config reader leaves out: config.head_dim from the file's
    `{arch}.attention.key_length` (it keeps the config class's default: Qwen3's 128
    whatever the file), Llama 3.x's rotary scaling, which llama.cpp's converter stores
    only as a `rope_freqs` tensor of per-frequency factors, the experts' widths, and
    Mixtral, which llama.cpp stores as a "llama" file with experts."""
    from services.common.gguf_file import GGUFFile

    gguf = GGUFFile(gguf_path)
    config = _mixtral_config(config, gguf.architecture, gguf.metadata)
    key_length = gguf.metadata.get(f"{gguf.architecture}.attention.key_length")
    if key_length:
        config.head_dim = int(key_length)
    if gguf.architecture == "gemma3":
        _fix_gemma3(config, gguf.metadata)
    if gguf.architecture == "phi3":
        _fix_phi3(config, gguf)
    _fix_experts(config, gguf.architecture, gguf.metadata)
    factors = next((t for t in gguf.tensors if t.name == "rope_freqs.weight"), None)
    if factors is not None and factors.type_name == "F32":
        theta = float(config.rope_parameters["rope_theta"])
        values = gguf.raw(factors).reshape(-1).view("<f4")
        config.rope_parameters = llama3_rope_parameters(values.tolist(), theta, gguf_path)
    return config


def _mixtral_config(config: object, arch: str, metadata: dict) -> object:
    """A "llama" file with `llama.expert_count` experts is a Mixtral (every MLP a mixture of
    that many experts, `llama.expert_used_count` per token): its config as MixtralConfig."""
    experts = int(metadata.get(f"{arch}.expert_count", 0) or 0)
    if arch not in ("llama", "mistral") or experts == 0:
        return config
    from transformers import MixtralConfig

    values = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    mixtral = MixtralConfig(**values)
    mixtral.num_local_experts = experts
    mixtral.num_experts_per_tok = int(metadata[f"{arch}.expert_used_count"])
    return mixtral


def _fix_experts(config: object, arch: str, metadata: dict) -> None:
    """A mixture's widths, which transformers' GGUF config reader leaves at the config
    class's defaults: each expert's (`expert_feed_forward_length`) and Qwen2-MoE's shared
    expert's (`expert_shared_feed_forward_length`)."""
    width = metadata.get(f"{arch}.expert_feed_forward_length")
    if width:
        config.moe_intermediate_size = int(width)
    shared = metadata.get(f"{arch}.expert_shared_feed_forward_length")
    if shared:
        config.shared_expert_intermediate_size = int(shared)


def _fix_gemma3(config: object, metadata: dict) -> None:
    """Gemma 3 facts the file holds only as llama.cpp assumes them: the attention scale
    (1 / sqrt(head_dim), but hidden / heads for the 62-layer 27B) and the global layers'
    linear rotary scaling (4B and larger)."""
    heads, layers = int(config.num_attention_heads), int(config.num_hidden_layers)
    big = layers == 62  # llama.cpp's test for the 27B
    config.query_pre_attn_scalar = config.hidden_size // heads if big else config.head_dim
    if metadata.get("gemma3.rope.scaling.type") == "linear":
        factor = float(metadata["gemma3.rope.scaling.factor"])
        full = dict(config.rope_parameters["full_attention"])
        config.rope_parameters["full_attention"] = {**full, "rope_type": "linear", "factor": factor}


def _fix_phi3(config: object, gguf) -> None:
    """Phi-3 / Phi-4-mini facts transformers' GGUF reader drops: the rotated share of each
    head (`rope.dimension_count`), longrope's per-frequency factors (llama.cpp keeps them
    as the `rope_factors_short` / `rope_factors_long` tensors) with its original context,
    the sliding window, the tied embedding (no `output` tensor) and the padding id."""
    meta, names = gguf.metadata, {t.name: t for t in gguf.tensors}
    rope = {"rope_type": "default", "rope_theta": float(config.rope_parameters["rope_theta"])}
    rotated = meta.get("phi3.rope.dimension_count")
    if rotated:
        rope["partial_rotary_factor"] = int(rotated) / int(config.head_dim)
    short, long = names.get("rope_factors_short.weight"), names.get("rope_factors_long.weight")
    if short is not None and long is not None:
        original = int(meta["phi3.rope.scaling.original_context_length"])
        rope |= {
            "rope_type": "longrope",
            "short_factor": gguf.raw(short).reshape(-1).view("<f4").tolist(),
            "long_factor": gguf.raw(long).reshape(-1).view("<f4").tolist(),
            "original_max_position_embeddings": original,
        }
        config.original_max_position_embeddings = original
    config.rope_parameters = rope
    config.sliding_window = int(meta.get("phi3.attention.sliding_window", 0)) or None
    config.tie_word_embeddings = "output.weight" not in names
    pad = meta.get("tokenizer.ggml.padding_token_id")  # else Phi3Config's 32000, any vocab
    config.pad_token_id = int(pad) if pad is not None and int(pad) < config.vocab_size else None


# Llama 3.x's rotary scaling as Meta ships it (Llama 3.1 / 3.2 / 3.3: factor 8 or 32, low 1,
# high 4, 8192 original positions); the file's factors are matched against these.
_LLAMA3_CANDIDATES = tuple(
    (factor, 1.0, 4.0, original)
    for factor in (8.0, 32.0, 16.0, 4.0, 2.0)
    for original in (8192, 4096, 2048, 16384, 32768, 131072)
)


def llama3_factors(
    head_dim: int, theta: float, factor: float, low: float, high: float, original: int
) -> list[float]:
    """llama.cpp's rope_freqs for a llama3 scaling: how much each frequency is divided by."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _fit_llama3(factors: list[float], theta: float) -> dict | None:
    """The llama3 scaling of `factors` solved from its smooth part, or None. The factors
    depend on (original, low, high) only through a = original / (high - low) and
    b = -low / (high - low) (smooth = a / wavelen + b), so low = 1 loses nothing; two
    frequencies strictly between 1 and the factor give a and b, every other one must agree."""
    head_dim, factor = 2 * len(factors), max(factors)
    wavelens = [2 * math.pi * theta ** (2 * i / head_dim) for i in range(len(factors))]
    smooth = [(1 / f - 1 / factor) / (1 - 1 / factor) for f in factors] if factor > 1 else []
    medium = [i for i, f in enumerate(factors) if 1 + 1e-6 < f < factor * (1 - 1e-6)]
    if factor <= 1 or len(medium) < 2:
        return None
    i, j = medium[0], medium[-1]
    a = (smooth[i] - smooth[j]) / (1 / wavelens[i] - 1 / wavelens[j])
    b = smooth[i] - a / wavelens[i]
    if b >= 0:
        return None
    high = 1 - 1 / b
    original = a * (high - 1)
    if abs(original - round(original)) < 1e-3 * original:
        original = round(original)
    expected = llama3_factors(head_dim, theta, factor, 1.0, high, original)
    if not all(abs(x - y) <= 1e-4 * y for x, y in zip(factors, expected, strict=True)):
        return None
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def llama3_rope_parameters(factors: list[float], theta: float, gguf_path: Path) -> dict:
    """HF's llama3 rope_parameters that give the file's per-frequency `factors`; a
    ModelLoadError when none of the shipped scalings does."""
    head_dim = 2 * len(factors)
    for factor, low, high, original in _LLAMA3_CANDIDATES:
        expected = llama3_factors(head_dim, theta, factor, low, high, original)
        if all(abs(a - b) <= 1e-4 * b for a, b in zip(factors, expected, strict=True)):
            return {
                "rope_type": "llama3",
                "rope_theta": theta,
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    fitted = _fit_llama3(factors, theta)
    if fitted is not None:
        return fitted
    raise ModelLoadError(
        f"GGUF file {gguf_path}: its rope_freqs tensor matches no llama3 rotary scaling "
        f"(factor, low/high frequency factors, original positions) pagestream knows."
    )


def _read_tokenizer(gguf_path: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
