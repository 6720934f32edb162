"""F32 / BF16 GGUF files of the weights pagestream runs from a GGUF model, for llama.cpp.

    f32 = export_gguf(source_gguf("smollm2-135m-instruct"), "F32")  # ...Q4_1.F32.gguf

Metadata and tensor names as in the source; BF16 rounds matrices as torch casts, norms stay
F32 (as llama.cpp's converter). `pagestream.source` (name:size) marks a stale export."""

from __future__ import annotations

import logging
import os
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
    from services.common.model_source import MODEL_ALIASES, gguf_source

    name = str(model)
    if (path := gguf_source(name)) is not None:
        return path
    if name.lower() in MODEL_ALIASES:
        raise ValueError(f"the GGUF file of {name!r} was not found; run `make setup`.")
    raise ValueError(
        f"{name!r} is not a GGUF model: the llama.cpp comparison exports F32 / BF16 GGUF "
        "files only from a model pagestream loads from a .gguf file (not from HF folders)."
    )


def export_gguf(source: Path, dtype: str, out_dir: Path | None = None) -> Path:
    """The `dtype` GGUF file of `source`'s weights (in the cache unless told), written when
    missing or stale, under a temporary name renamed into place."""
    from gguf import GGUFReader

    from services.common.cache_dir import cache_dir

    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {EXPORT_DTYPES}, got {dtype!r}.")
    target = (out_dir or cache_dir() / "gguf") / f"{source.stem}.{dtype}.gguf"
    fingerprint = f"{source.name}:{source.stat().st_size}"
    try:
        if GGUFReader(target).fields[SOURCE_KEY].contents() == fingerprint:
            return target
    except (OSError, ValueError, KeyError):
        pass  # missing, unreadable or from another source: written again
    target.parent.mkdir(parents=True, exist_ok=True)
    start, tmp = time.perf_counter(), target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        _write(source, tmp, dtype, fingerprint)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("wrote %s in %.1f s", target, time.perf_counter() - start)
    return target


def _write(source: Path, path: Path, dtype: str, fingerprint: str) -> None:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(source)
    writer = GGUFWriter(path, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key not in _SKIPPED_KEYS:
            writer.add_key_value(key, *_field_value(field))
    bf16 = dtype == "BF16"
    writer.add_file_type(LlamaFileType.MOSTLY_BF16 if bf16 else LlamaFileType.ALL_F32)
    writer.add_key_value(SOURCE_KEY, fingerprint, GGUFValueType.STRING)
    shapes = [tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors]  # [rows, cols]
    for tensor, shape in zip(reader.tensors, shapes, strict=True):
        count = int(np.prod(shape))
        if bf16 and len(shape) >= 2:  # bf16 as raw bytes: uint8 [rows, 2 * cols]
            byte_shape, raw = (*shape[:-1], shape[-1] * 2), GGMLQuantizationType.BF16
            writer.add_tensor_info(tensor.name, byte_shape, np.dtype(np.uint8), count * 2, raw)
        else:
            writer.add_tensor_info(tensor.name, shape, np.dtype(np.float32), count * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor, shape in zip(reader.tensors, shapes, strict=True):  # one in memory at a time
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        if bf16 and len(shape) >= 2:
            values = quantize(values, GGMLQuantizationType.BF16)
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
