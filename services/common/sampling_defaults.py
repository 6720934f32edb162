"""The one merge rule for sampling values: what a request sets > the model's default (its
generation_config.json, read by services/frontend/generation_defaults.py) > vLLM's default
(SamplingParams' own field default)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.common.sampling_params import SamplingParams


def sampling_params_with_defaults(
    requested: Mapping[str, Any], model_defaults: Mapping[str, Any] | None
) -> SamplingParams:
    """SamplingParams from the fields a request set, the model's defaults filling the rest
    (ValueError on a bad value, as SamplingParams raises it)."""
    return SamplingParams(**{**(model_defaults or {}), **requested})
