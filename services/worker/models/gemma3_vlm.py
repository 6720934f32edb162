"""Gemma 3 with images (HF Gemma3ForConditionalGeneration): SigLIP's vision tower over
the one square image, its last norm, then the projector (average pool to
mm_tokens_per_image rows, RMSNorm, projection) into Gemma 3's text model.

As HF's, an image's tokens attend to each other both ways (`bidirectional_images`: the
worker gives their rows a key limit at the image's end, AttentionMetadata.key_limits),
on sliding-window layers too (within the row's own window); every other row is causal.
The torch and C++ CPU kernels honour the limits; the triton kernel does not, so the
model refuses that backend."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from services.worker.layers.attention import AttentionOps
from services.worker.models.llama import Gemma3ForCausalLM
from services.worker.models.llava import LLAVA_CHECKPOINT_PREFIXES, LLAVA_VISION_PREFIXES
from services.worker.models.vision.projectors import Gemma3Projector
from services.worker.models.vision.vision_language_model import VisionLanguageModel, required
from services.worker.models.vision.vision_spec import VisionSpec
from services.worker.models.vision.vision_transformer import VisionTransformer


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    checkpoint_prefixes = LLAVA_CHECKPOINT_PREFIXES  # the released checkpoints' layout
    vision_prefixes = LLAVA_VISION_PREFIXES
    text_model_class = Gemma3ForCausalLM
    bidirectional_images = True

    def set_attention_ops(self, ops: AttentionOps) -> None:
        if ops.name == "triton":
            raise ValueError(
                "Gemma 3 with images attends bidirectionally within each image, which the "
                "triton attention backend does not do; use --attention-backend torch."
            )
        super().set_attention_ops(ops)

    def build_vision(self, config: PretrainedConfig) -> None:
        spec = VisionSpec.siglip(config.vision_config, bucketed_positions=False)
        self.vision_tower = VisionTransformer(spec)
        self.multi_modal_projector = Gemma3Projector(
            spec.hidden_size,
            spec.patches_per_side,
            int(config.mm_tokens_per_image),
            self.config.hidden_size,
            spec.norm_eps,
        )

    def image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        pixel_values = required(data, "pixel_values")  # [1, 3, H, W]
        if pixel_values.dim() != 4 or pixel_values.shape[0] != 1:
            raise ValueError(
                f"Gemma 3's pixel_values must be one image [1, 3, H, W]; got "
                f"{list(pixel_values.shape)}."
            )
        rows = self.multi_modal_projector(self.vision_tower(pixel_values))
        return rows.reshape(-1, self.config.hidden_size)
