"""LLaVA (HF LlavaForConditionalGeneration): CLIP's vision tower, read at
`vision_feature_layer` (one layer's hidden states, or several concatenated), the class
token dropped ("default") or kept ("full"), through a two-linear projector into the
Llama-family text model. One image of the trained size gives one row per patch."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from services.common.model_errors import ModelLoadError
from services.worker.models.vision.projectors import LlavaProjector
from services.worker.models.vision.vision_language_model import VisionLanguageModel, required
from services.worker.models.vision.vision_spec import VisionSpec
from services.worker.models.vision.vision_transformer import VisionTransformer

# A vision tower and a multi_modal_projector beside the language model: LLaVA's layout,
# which Gemma 3's checkpoints share.
LLAVA_CHECKPOINT_PREFIXES = (
    # transformers 5's modules
    ("model.language_model.", "model."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    # llava-hf's layout (also what transformers 5 saves)
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.vision_model.", "vision_tower."),
)
LLAVA_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


class LlavaForConditionalGeneration(VisionLanguageModel):
    checkpoint_prefixes = LLAVA_CHECKPOINT_PREFIXES
    vision_prefixes = LLAVA_VISION_PREFIXES

    def build_vision(self, config: PretrainedConfig) -> None:
        spec = VisionSpec.clip(config.vision_config)
        self.vision_tower = VisionTransformer(spec)
        self.feature_indices = feature_indices(config.vision_feature_layer, spec.num_layers)
        indices = self.feature_indices
        strategy = config.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ModelLoadError(f"vision_feature_select_strategy {strategy!r} is not supported")
        self.drop_class_token = strategy == "default"
        self.multi_modal_projector = LlavaProjector(
            spec.hidden_size * len(indices),
            self.config.hidden_size,
            config.projector_hidden_act,
            bool(getattr(config, "multimodal_projector_bias", True)),
        )

    def image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        pixel_values = required(data, "pixel_values")  # [1, 3, H, W]
        if pixel_values.dim() != 4 or pixel_values.shape[0] != 1:
            raise ValueError(
                f"LLaVA's pixel_values must be one image [1, 3, H, W]; got "
                f"{list(pixel_values.shape)}."
            )
        states = self.vision_tower.hidden_states(pixel_values, None, max(self.feature_indices))
        selected = [states[i] for i in self.feature_indices]  # each [1, 1 + N, vision_hidden]
        if self.drop_class_token:
            selected = [s[:, 1:] for s in selected]
        features = torch.cat(selected, dim=-1)  # [1, N, vision_hidden * layers]
        return self.multi_modal_projector(features).reshape(-1, self.config.hidden_size)


def feature_indices(layers: int | list[int], num_layers: int) -> list[int]:
    """vision_feature_layer (one index or several, negative from the end) as indices into
    HF's hidden_states: 0 the embeddings, i the output of layer i."""
    wanted = [layers] if isinstance(layers, int) else list(layers)
    states = num_layers + 1
    if not wanted or any(not -states <= i < states for i in wanted):
        raise ModelLoadError(
            f"vision_feature_layer {layers} is outside the tower's {num_layers} layers"
        )
    return [i % states for i in wanted]
