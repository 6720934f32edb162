"""Idefics3 / SmolVLM (HF Idefics3ForConditionalGeneration): SigLIP's vision tower over
each tile of the image (tiles of any size under a patch mask, padding tiles dropped),
its last norm, then the connector's pixel shuffle and linear into the Llama text model
(SmolLM2). Each tile gives (patches / scale_factor^2) rows, tiles in order."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from services.worker.models.vision.projectors import Idefics3Connector
from services.worker.models.vision.vision_language_model import VisionLanguageModel, required
from services.worker.models.vision.vision_spec import VisionSpec
from services.worker.models.vision.vision_transformer import VisionTransformer


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    checkpoint_prefixes = (
        ("model.text_model.", "model."),
        ("model.vision_model.", "vision_model."),
        ("model.connector.modality_projection.", "connector."),
    )
    vision_prefixes = ("vision_model.", "connector.")

    def build_vision(self, config: PretrainedConfig) -> None:
        spec = VisionSpec.siglip(config.vision_config, bucketed_positions=True)
        self.vision_model = VisionTransformer(spec)
        self.connector = Idefics3Connector(
            spec.hidden_size, int(config.scale_factor), self.config.hidden_size
        )

    def image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        pixel_values = required(data, "pixel_values")  # [1, tiles, 3, H, W]
        if pixel_values.dim() != 5 or pixel_values.shape[0] != 1:
            raise ValueError(
                "Idefics3's pixel_values must be one image's tiles [1, tiles, 3, H, W]; got "
                f"{list(pixel_values.shape)}."
            )
        tiles = pixel_values[0]  # [tiles, 3, H, W]
        pixel_mask = data.get("pixel_attention_mask")
        if pixel_mask is None:
            pixel_mask = torch.ones(tiles.shape[0], *tiles.shape[2:], dtype=torch.bool)
        elif pixel_mask.shape != (1, tiles.shape[0], *tiles.shape[2:]):
            raise ValueError(
                f"pixel_attention_mask {list(pixel_mask.shape)} does not match pixel_values "
                f"{list(pixel_values.shape)}."
            )
        else:
            pixel_mask = pixel_mask[0].bool()  # [tiles, H, W]
        real = (tiles != 0).flatten(1).any(dim=1)  # padding tiles are all zeros (HF's test)
        tiles, pixel_mask = tiles[real], pixel_mask[real]
        if tiles.shape[0] == 0:
            raise ValueError("the image has no tile with pixels.")
        patch_mask = self._patch_mask(pixel_mask)  # [tiles, H / p, W / p]
        if not bool(patch_mask[:, 0, 0].all()):  # a tile's pixels start at its top left
            raise ValueError(
                "a tile of the image has pixels but its pixel_attention_mask keeps none of its "
                "top-left patch (padding lies below and right of the pixels)."
            )
        rows = self.vision_model(tiles, patch_mask)  # [tiles, patches, vision_hidden]
        return self.connector(rows).reshape(-1, self.config.hidden_size)

    def _patch_mask(self, pixel_mask: torch.Tensor) -> torch.Tensor:
        """[tiles, H, W] bool -> [tiles, H / p, W / p]: a patch is real when any of its
        pixels is."""
        tiles, height, width = pixel_mask.shape
        p = self.vision_model.spec.patch_size
        if height % p or width % p:
            raise ValueError(f"a tile of {height}x{width} pixels is not whole {p}-pixel patches.")
        return pixel_mask.reshape(tiles, height // p, p, width // p, p).any(dim=4).any(dim=2)
