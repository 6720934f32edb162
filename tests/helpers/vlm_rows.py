"""One image of a tiny VLM's prompt as each side sees it: the HF processor's tensors,
the ImageInput the frontend would hand the worker, and HF's encoder rows for it."""

from __future__ import annotations

import torch

from services.common.image_input import ImageInput
from tests.helpers.tiny_vlms import random_image

PROMPT = "<s>user: <image>what is this?\n<s>assistant:"


def processed(processor, size=(50, 40), seed=1) -> dict[str, torch.Tensor]:
    return dict(processor(text=PROMPT, images=[random_image(seed, size)], return_tensors="pt"))


def image_input(model, inputs: dict[str, torch.Tensor]) -> ImageInput:
    """The prompt's one image as the frontend hands it over: its span from the first to
    the last image token, its processor tensors as numpy."""
    where = (inputs["input_ids"][0] == model.image_token_id).nonzero().flatten()
    start, end = int(where[0]), int(where[-1]) + 1
    data = {k: v.numpy() for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    return ImageInput(start, end - start, len(where), "hash", data)


def hf_image_rows(hf, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    pixels = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    with torch.no_grad():
        features = hf.get_image_features(**pixels).pooler_output
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
