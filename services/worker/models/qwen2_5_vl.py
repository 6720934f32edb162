"""Qwen2.5-VL (HF Qwen2_5_VLForConditionalGeneration): its own windowed vision
transformer and patch merger (vision/qwen2_5_vision_transformer.py) into the Qwen2 text
model, whose rotary is M-RoPE: positions [3, T] (temporal, row, column), the rotary
frequencies split between them by `mrope_section` (layers/rotary_embedding.py). The
worker computes a request's positions from its images' grids
(multimodal/mrope_positions.py); a text token's three are equal.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from services.common.rank_info import RankInfo
from services.worker.models.forward_plan import TORCH_CAUSAL, ForwardPlan
from services.worker.models.llama import Qwen2ForCausalLM
from services.worker.models.vision.qwen2_5_vision_transformer import Qwen2_5VisionTransformer
from services.worker.models.vision.vision_language_model import VisionLanguageModel, required

# HF's sections when the config names none (Qwen2.5-VL's released 128-wide heads)
DEFAULT_MROPE_SECTION = [16, 24, 24]


class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel):
    checkpoint_prefixes = (
        # transformers 5's modules
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
        # the released checkpoints' layout (also what transformers 5 saves): model.*,
        # visual.*, lm_head.* as they are
    )
    vision_prefixes = ("visual.",)
    text_model_class = Qwen2ForCausalLM

    def __init__(
        self,
        config: PretrainedConfig,
        rank: RankInfo | None = None,
        pooling: bool = False,
        expert_parallel: bool = False,
        plan: ForwardPlan = TORCH_CAUSAL,
    ) -> None:
        with_mrope_section(config.get_text_config())
        super().__init__(config, rank, pooling, expert_parallel, plan)
        # the worker's InputBatch computes the steps' [3, T] positions with it
        self.mrope_merge_size = int(config.vision_config.spatial_merge_size)

    def build_vision(self, config: PretrainedConfig) -> None:
        self.visual = Qwen2_5VisionTransformer(config.vision_config)

    def image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        pixel_values = required(data, "pixel_values")  # [t * h * w, C * T * P * P]
        return self.visual(pixel_values, image_grid(data))


def image_grid(data: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """The one image's (t, h, w) in patches, from its image_grid_thw [1, 3]."""
    grid = required(data, "image_grid_thw")
    if grid.dim() != 2 or tuple(grid.shape) != (1, 3) or grid.is_floating_point():
        raise ValueError(
            f"Qwen2.5-VL's image_grid_thw must be one image's [1, 3] integers; got "
            f"{list(grid.shape)} {grid.dtype}."
        )
    t, h, w = (int(v) for v in grid[0].tolist())
    return t, h, w


def with_mrope_section(text_config: PretrainedConfig) -> None:
    """Writes HF's default mrope_section into the text config's rope parameters where it
    names none (HF's rotary assumes it): the rotary then builds its M-RoPE kind."""
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict) and "mrope_section" not in params:
        params["mrope_section"] = list(DEFAULT_MROPE_SECTION)
    scaling = getattr(text_config, "rope_scaling", None)
    if not isinstance(params, dict) and isinstance(scaling, dict):
        scaling.setdefault("mrope_section", list(DEFAULT_MROPE_SECTION))
