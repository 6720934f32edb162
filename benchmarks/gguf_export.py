"""F32 and BF16 GGUF files of the weights pagestream runs, for llama.cpp (benchmarks/llamacpp.py).

pagestream's models come from GGUF files that it dequantizes once into an HF folder
(services/common/gguf_conversion.py). The same dequantized weights, written back as a GGUF
file with the source's metadata and tensor names, are what llama.cpp runs in the benchmark:

    source = source_gguf("smollm2-135m-instruct")   # $PAGESTREAM_CACHE/gguf/...Q4_1.gguf
    f32 = export_gguf(source, "F32")                # ...Q4_1.F32.gguf, written once

Every metadata field (tokenizer arrays included) is copied unchanged except
`general.file_type`; every tensor is dequantized to float32 and written as F32, or, for
BF16, as bf16 (round to nearest even, as torch's cast) when it is a matrix, keeping the 1-D
norms in F32 as llama.cpp's own converter does. The tensor names (and so llama.cpp's q/k
row permutation) stay those of the source. A file is written under a temporary name and
renamed into place; `pagestream.source` in it records the source's name and size, so an
export is redone when the source changes. Models given as HF folders are not supported.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

EXPORT_DTYPES = ("F32", "BF16")
SOURCE_KEY = "pagestream.source"
_SKIPPED_KEYS = ("general.architecture", "general.file_type", SOURCE_KEY)


def source_gguf(model: str | os.PathLike[str]) -> Path:
    """The GGUF file a model name stands for (an alias, a .gguf file, or a folder holding
    exactly one); ValueError for a model that does not come from a GGUF file."""
    from services.common.model_source import MODEL_ALIASES, alias_gguf_candidates

    name = str(model)
    if name.lower() in MODEL_ALIASES:
        found = [p for p in alias_gguf_candidates(name.lower()) if p.is_file()]
        if found:
            return found[0]
        raise ValueError(f"the GGUF file of {name!r} was not found; run `make setup`.")
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1 and not (path / "config.json").is_file():
        return ggufs[0]
    raise ValueError(
        f"{name!r} is not a GGUF model: the llama.cpp comparison exports F32 / BF16 GGUF "
        "files only from models that pagestream loads from a .gguf file (HF folders are not "
        "supported yet)."
    )


def export_path(source: Path, dtype: str, out_dir: Path | None = None) -> Path:
    from services.common.model_source import cache_dir

    return (out_dir or cache_dir() / "gguf") / f"{source.stem}.{dtype}.gguf"


def export_gguf(source: Path, dtype: str, out_dir: Path | None = None) -> Path:
    """The `dtype` ("F32" or "BF16") GGUF file of `source`'s weights, written when missing
    or stale."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {EXPORT_DTYPES}, got {dtype!r}.")
    target = export_path(source, dtype, out_dir)
    if _is_current(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    try:
        _write(source, Path(tmp_name), dtype)
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    logger.info("wrote %s in %.1f s", target, time.perf_counter() - start)
    return target


def _fingerprint(source: Path) -> str:
    return f"{source.name}:{source.stat().st_size}"


def _is_current(target: Path, source: Path) -> bool:
    from gguf import GGUFReader

    if not target.is_file():
        return False
    try:
        field = GGUFReader(target).fields.get(SOURCE_KEY)
    except (OSError, ValueError):
        return False
    return field is not None and field.contents() == _fingerprint(source)


def _write(source: Path, path: Path, dtype: str) -> None:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(path, arch)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key not in _SKIPPED_KEYS:
            writer.add_key_value(key, *_field_value(field))
    bf16 = dtype == "BF16"
    writer.add_file_type(LlamaFileType.MOSTLY_BF16 if bf16 else LlamaFileType.ALL_F32)
    writer.add_key_value(SOURCE_KEY, _fingerprint(source), GGUFValueType.STRING)

    def to_bf16(tensor) -> bool:
        return bf16 and len(tensor.shape) >= 2

    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # numpy order: [rows, cols]
        count = int(np.prod(shape))
        if to_bf16(tensor):
            byte_shape = (*shape[:-1], shape[-1] * 2)
            raw = GGMLQuantizationType.BF16
            writer.add_tensor_info(tensor.name, byte_shape, np.dtype(np.uint8), count * 2, raw)
        else:
            writer.add_tensor_info(tensor.name, shape, np.dtype(np.float32), count * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:  # one tensor in memory at a time
        shape = tuple(int(n) for n in reversed(tensor.shape))
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        if to_bf16(tensor):
            values = quantize(values, GGMLQuantizationType.BF16)  # uint8 [rows, 2 * cols]
        writer.write_tensor_data(values)
    writer.close()


def _field_value(field) -> tuple:
    """(value, type, sub_type) of a reader field for GGUFWriter.add_key_value; strings are
    copied as raw bytes (a tokenizer's may not be valid UTF-8)."""
    from gguf import GGUFValueType

    main, sub = field.types[0], field.types[-1]
    if main == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), main, None
    if main != GGUFValueType.ARRAY:
        return field.contents(), main, None
    if len(field.types) != 2:
        raise ValueError(f"nested metadata arrays are not supported ({field.name}).")
    if sub == GGUFValueType.STRING:
        return [bytes(field.parts[i]) for i in field.data], main, sub
    return list(field.contents()), main, sub
