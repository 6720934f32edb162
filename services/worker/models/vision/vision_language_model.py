"""VisionLanguageModel: a Llama-family text model (exactly LlamaForCausalLM on the
config's text_config: torch or native step, KV cache, logits, LoRA unchanged) plus an
image encoder whose rows the model runner splices into the prompt's image positions.

    embed(input_ids [T]) -> [T, hidden]             the rows forward would start from
    encode_image(image) -> [image.num_embeds, hidden] the image's rows (same dtype)
    forward(..., inputs_embeds=[T, hidden])         the first stage starts from them

A family (llava.py, idefics3.py) builds its vision modules (`build_vision`), runs them on
one image's processor tensors (`image_features`) and names where its checkpoint keeps
them (`checkpoint_prefixes`). The vision modules live on the first pipeline stage only
(the one that embeds), replicated over tensor-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from transformers import PretrainedConfig

from services.common.image_input import ImageInput
from services.common.rank_info import RankInfo
from services.worker.models.decoder_spec import DecoderSpec
from services.worker.models.forward_plan import TORCH_CAUSAL, ForwardPlan
from services.worker.models.llama import LlamaForCausalLM

# An image's processor tensor has at most this many elements (a bound on what a request
# hands the encoder: 64 tiles of 3 x 1024 x 1024 floats).
MAX_IMAGE_ELEMENTS = 64 * 3 * 1024 * 1024


class VisionLanguageModel(LlamaForCausalLM):
    # (checkpoint prefix, our prefix), first match wins: both the transformers-5 layout
    # and older ones map to "model." / "lm_head." (the text model) or a vision module.
    checkpoint_prefixes: tuple[tuple[str, str], ...] = ()
    # our prefixes of the vision modules' tensors
    vision_prefixes: tuple[str, ...] = ()
    # the family of the text model (its description: DecoderSpec)
    text_model_class: type[LlamaForCausalLM] = LlamaForCausalLM

    def __init__(
        self,
        config: PretrainedConfig,
        rank: RankInfo | None = None,
        pooling: bool = False,
        expert_parallel: bool = False,
        plan: ForwardPlan = TORCH_CAUSAL,
    ) -> None:
        text_config = config.get_text_config()
        super().__init__(text_config, rank, pooling, expert_parallel, plan)
        self.multimodal_config = config  # self.config is the text model's (its sizes)
        self.image_token_id = image_token_id(config)
        self._vision_prepared = False
        if self.rank.is_first_stage:
            self.build_vision(config)

    @classmethod
    def describe(cls, config: PretrainedConfig) -> DecoderSpec:
        return cls.text_model_class.describe(config.get_text_config())

    def build_vision(self, config: PretrainedConfig) -> None:
        """The family's vision modules, named as `vision_prefixes` says."""
        raise NotImplementedError

    def image_features(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's processor tensors -> its rows [num_embeds, text_hidden]."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, hidden] in the residual's dtype (the family's
        embedding scale included): the rows forward starts from without inputs_embeds."""
        return self.model.embed(input_ids).to(self.hidden_dtype)

    @torch.no_grad()
    def encode_image(self, image: ImageInput) -> torch.Tensor:
        """The image's rows [image.num_embeds, hidden] in the residual's dtype; ValueError
        for tensors the tower cannot read or a row count other than num_embeds."""
        data = {name: _tensor(name, value) for name, value in image.data.items()}
        self.prepare_vision()
        rows = self.image_features(data).to(self.hidden_dtype)
        if rows.shape[0] != image.num_embeds:
            raise ValueError(
                f"the image encodes to {rows.shape[0]} rows but its placeholder holds "
                f"{image.num_embeds} image tokens."
            )
        return rows

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        self.prepare_vision()  # every tensor is in (else ModelLoadError): packed at load
        return loaded

    def prepare_vision(self) -> None:
        """The vision modules' final form (fused, packed linears: their `prepare`), made
        once, after loading (load_weights; encode_image for a model loaded otherwise)."""
        if self._vision_prepared or not self.rank.is_first_stage:  # later stages: none
            return
        for prefix in self.vision_prefixes:
            prepare = getattr(self.get_submodule(prefix.removesuffix(".")), "prepare", None)
            if prepare is not None:
                prepare()
        self._vision_prepared = True

    # --- checkpoint names ---------------------------------------------------------------

    def checkpoint_name(self, name: str) -> str:  # type: ignore[override]
        for theirs, ours in self.checkpoint_prefixes:
            if name.startswith(theirs):
                name = ours + name.removeprefix(theirs)
                break
        if self._is_vision(name):
            return name
        return LlamaForCausalLM.checkpoint_name(name)

    def _is_vision(self, name: str) -> bool:
        return name.startswith(self.vision_prefixes)

    def owns_weight(self, name: str) -> bool:
        name = self.checkpoint_name(name)
        if self._is_vision(name):
            return self.rank.is_first_stage
        return super().owns_weight(name)

    def _target_param(self, name: str) -> tuple[str, str | int | None]:
        if self._is_vision(name):  # torch modules under HF's names: no fused q/k/v
            return name, None
        return super()._target_param(name)


def image_token_id(config: PretrainedConfig) -> int:
    """The id of the token whose positions take the image's rows."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(config).__name__} names no image token (image_token_id).")


def required(data: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in data:
        raise ValueError(f"the image's processor tensors have no {name!r}.")
    return data[name]


def _tensor(name: str, value: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A processor array as a tensor, bounded in size."""
    try:
        array = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the image's {name} is not a numeric array: {exc}") from exc
    if array.numel() > MAX_IMAGE_ELEMENTS:
        raise ValueError(
            f"the image's {name} has {array.numel()} elements; at most {MAX_IMAGE_ELEMENTS}."
        )
    return array
