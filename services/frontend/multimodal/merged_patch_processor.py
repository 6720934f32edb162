"""MergedPatchProcessor: Qwen2.5-VL's processor for images, without its video half.

transformers builds Qwen2_5_VLProcessor only with its video processor, which needs
torchvision; the images need only the image processor (resize within the pixel bounds,
flattened patches, image_grid_thw) and the tokenizer: each <|image_pad|> of the text
becomes one pad per merged patch (t * h * w / merge^2 of its image), as HF's processor
expands it. Called as ImageProcessor calls an HF processor.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

IMAGE_PAD = "<|image_pad|>"
MODEL_TYPES = frozenset({"qwen2_5_vl"})


class MergedPatchProcessor:
    def __init__(self, image_processor, tokenizer) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = IMAGE_PAD
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.merge = int(image_processor.merge_size)

    @classmethod
    def from_folder(cls, folder: str | Path) -> MergedPatchProcessor | None:
        """The folder's processor where it is a Qwen2.5-VL's, else None."""
        from transformers import AutoImageProcessor, AutoTokenizer

        try:
            config = json.loads((Path(folder) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or config.get("model_type") not in MODEL_TYPES:
            return None
        image_processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return cls(image_processor, tokenizer)

    def __call__(
        self, text: str, images: list, return_tensors: str = "np", add_special_tokens: bool = True
    ) -> dict[str, np.ndarray]:
        """input_ids [1, n] with each pad expanded, pixel_values [patches, features],
        image_grid_thw [images, 3]."""
        pixels = self.image_processor(images=images, return_tensors="np")
        grids = np.asarray(pixels["image_grid_thw"]).tolist()
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if ids.count(self.image_token_id) != len(grids):
            raise ValueError(
                f"the text has {ids.count(self.image_token_id)} image pads for {len(grids)} images."
            )
        expanded, pending = [], iter(grids)
        for token in ids:
            if token != self.image_token_id:
                expanded.append(token)
                continue
            t, h, w = next(pending)
            expanded += [token] * (t * h * w // self.merge**2)
        return {
            "input_ids": np.asarray([expanded], np.int64),
            **{k: np.asarray(v) for k, v in pixels.items()},
        }
