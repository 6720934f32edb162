"""VisionSpec: the shape of a vision transformer and what differs between its families.

CLIP (LLaVA's tower) prepends a class token, norms the embeddings before the first layer
(its `pre_layrnorm`) and has no bias on the patch convolution; SigLIP (Idefics3's tower)
has no class token, a biased convolution, a norm after the last layer, and Idefics3's
variant reads tiles of any size under a patch mask, its position ids bucketed onto the
trained grid. Everything else (pre-norm layers, a two-linear MLP, full attention over the
patches) is shared and built once (vision_transformer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig


@dataclass(frozen=True)
class VisionSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int  # the trained square's side: its patches are the position table's
    num_channels: int
    norm_eps: float
    activation: str  # the MLP's, by HF's name
    class_token: bool  # CLIP: a learned token before the patches (position 0)
    pre_norm: bool  # CLIP: a layer norm of the embeddings before the first layer
    patch_bias: bool
    bucketed_positions: (
        bool  # Idefics3: tiles of any size, positions bucketed (patch_embeddings.py)
    )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def clip(cls, config: PretrainedConfig) -> VisionSpec:
        """CLIP's vision tower (LLaVA)."""
        return cls(
            **_shared(config),
            class_token=True,
            pre_norm=True,
            patch_bias=False,
            bucketed_positions=False,
        )

    @classmethod
    def siglip(cls, config: PretrainedConfig, bucketed_positions: bool) -> VisionSpec:
        """SigLIP's vision tower (Idefics3's, with `bucketed_positions`)."""
        return cls(
            **_shared(config),
            class_token=False,
            pre_norm=False,
            patch_bias=True,
            bucketed_positions=bucketed_positions,
        )


def _shared(config: PretrainedConfig) -> dict:
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"the vision config's hidden_size {config.hidden_size} is not a multiple of its "
            f"{config.num_attention_heads} attention heads."
        )
    return dict(
        hidden_size=int(config.hidden_size),
        intermediate_size=int(config.intermediate_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=int(config.num_attention_heads),
        patch_size=int(config.patch_size),
        image_size=int(config.image_size),
        num_channels=int(getattr(config, "num_channels", 3)),
        norm_eps=float(config.layer_norm_eps),
        activation=str(config.hidden_act),
    )
