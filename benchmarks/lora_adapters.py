"""The random LoRA adapters of `pagestream bench lora` (benchmarks/lora.py): made once per
model, rank and index into a folder under $PAGESTREAM_CACHE/bench-lora (or the options'
adapter_dir), each stamped with what it was made from and made again when that changed.

peft.get_peft_model over the model's HF weights, every q/k/v/o/gate/up/down projection of
every layer targeted, lora_alpha = r, init_lora_weights=False and then every A and B drawn
from a seeded normal of std `adapter_std`. `options` is the benchmark's LoRAOptions (model,
ranks, adapter_counts, adapter_std, adapter_dir).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from services.common.lora_config import TARGET_MODULES

logger = logging.getLogger(__name__)

ADAPTER_STD = 0.01  # every A and B ~ normal(0, std): outputs stay sensible text
ADAPTER_SEED = 0
ADAPTER_FOLDER = "bench-lora"  # under $PAGESTREAM_CACHE
STAMP = "pagestream_bench_lora.json"  # in each adapter's folder: what it was made from


def adapter_root(options) -> Path:
    from services.common.model_source import cache_dir

    return Path(options.adapter_dir) if options.adapter_dir else cache_dir() / ADAPTER_FOLDER


def _stamp(model: Path, rank: int, index: int, std: float) -> dict:
    """What an adapter folder is made from: the model's weights (path, sizes, times), the
    rank, its index (its seed) and the std."""
    weights = [
        [f.name, f.stat().st_size, f.stat().st_mtime_ns]
        for f in sorted(model.glob("*.safetensors"))
    ]
    return {
        "model": str(model),
        "weights": weights,
        "rank": rank,
        "index": index,
        "seed": ADAPTER_SEED,
        "std": std,
        "targets": list(TARGET_MODULES),
    }


def _is_made(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def adapter_folders(options) -> dict[int, list[str]]:
    """rank -> the folders of max(adapter_counts) adapters of that rank, each made once
    (again when the model's weights or the std changed)."""
    model = Path(options.model).resolve()
    digest = hashlib.sha256(str(model).encode()).hexdigest()[:8]
    root = adapter_root(options)
    count = max(options.adapter_counts)
    folders: dict[int, list[Path]] = {}
    missing: dict[int, list[tuple[int, Path, dict]]] = {}
    for rank in options.ranks:
        folders[rank] = [root / f"{model.name}-{digest}-r{rank}-{i}" for i in range(count)]
        for index, folder in enumerate(folders[rank]):
            stamp = _stamp(model, rank, index, options.adapter_std)
            if not _is_made(folder, stamp):
                missing.setdefault(rank, []).append((index, folder, stamp))
    if missing:
        made = sum(map(len, missing.values()))
        logger.info("making %d random LoRA adapters under %s", made, root)
        start = time.perf_counter()
        make_adapters(model, missing, options.adapter_std)
        logger.info("made them in %.1f s", time.perf_counter() - start)
    return {rank: [str(f) for f in found] for rank, found in folders.items()}


def make_adapters(model: Path, wanted: dict[int, list[tuple[int, Path, dict]]], std: float):
    """Random PEFT adapters: rank -> [(index, folder, stamp)], each A and B ~ normal(0,
    std) seeded by rank and index, written to a temporary folder then renamed."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise SystemExit(
            "pagestream bench lora makes its adapters with peft: `pip install peft`."
        ) from exc

    for rank, items in wanted.items():
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(
            r=rank,
            lora_alpha=rank,
            target_modules=list(TARGET_MODULES),
            lora_dropout=0.0,
            bias="none",
            init_lora_weights=False,
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(base, config)
        params = [p for name, p in peft_model.named_parameters() if ".lora_" in name]
        for index, folder, stamp in items:
            generator = torch.Generator().manual_seed(ADAPTER_SEED + 1000 * rank + index)
            with torch.no_grad():
                for param in params:
                    param.normal_(0.0, std, generator=generator)
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
            try:
                peft_model.save_pretrained(tmp)
                (tmp / STAMP).write_text(json.dumps(stamp))
                shutil.rmtree(folder, ignore_errors=True)
                tmp.rename(folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        del peft_model, base
        gc.collect()


def adapter_info(adapters: dict[int, list[str]], options) -> dict:
    """How the adapters were made, where they are and each rank's file size."""
    from services.common.lora_adapter import WEIGHTS_FILE

    return {
        "std": options.adapter_std,
        "seed": ADAPTER_SEED,
        "targets": list(TARGET_MODULES),
        "folder": str(adapter_root(options)),
        "per_rank": [
            {
                "rank": rank,
                "count": len(folders),
                "file_bytes": (Path(folders[0]) / WEIGHTS_FILE).stat().st_size,
            }
            for rank, folders in adapters.items()
        ],
    }
