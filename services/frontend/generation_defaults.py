"""Default sampling values from the model's generation_config.json, as vLLM applies them.

With `--generation-config auto` (the default) the values a model's authors set (temperature,
top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) become the defaults
for requests that leave them unset; a request's own values always win (one merge rule:
services/common/sampling_defaults.py). The file is read as transformers' GenerationConfig
diff, as vLLM reads it; `vllm` ignores it, a folder path reads the file from there.
"""

from __future__ import annotations

import logging
from pathlib import Path

from services.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SOURCES_HELP = "'auto' (the model folder's generation_config.json), 'vllm' (ignore it), or a folder"


def load_generation_defaults(model_folder: str | Path | None, source: str = "auto") -> dict:
    """The sampling defaults from generation_config.json ({} when there are none)."""
    if source == "vllm" or model_folder is None:
        return {}
    folder = Path(model_folder if source == "auto" else source)
    if not (folder / "generation_config.json").is_file():
        if source != "auto":
            raise ValueError(
                f"--generation-config {source}: no generation_config.json in that folder; "
                f"use {SOURCES_HELP}."
            )
        return {}
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(folder).to_diff_dict()
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {folder / 'generation_config.json'}: {exc}") from exc
    defaults = {key: diff[key] for key in SAMPLING_KEYS if diff.get(key) is not None}
    if diff.get("max_new_tokens") is not None:
        defaults["max_tokens"] = diff["max_new_tokens"]
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{folder / 'generation_config.json'}: {exc}") from exc
    if defaults:
        logger.info(
            "default sampling parameters from %s/generation_config.json: %s "
            "(--generation-config vllm ignores them)",
            folder,
            defaults,
        )
    return defaults
