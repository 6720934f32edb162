"""llama.cpp's vision projector file (llama-server's `--mmproj`, mmproj-*.gguf) in HF's terms.

An mmproj file ("clip" architecture) holds a vision encoder and the projector into a text
model, its hyperparameters under `clip.vision.*`. Three projector types read: "mlp" (LLaVA:
CLIP + two linears; llama.cpp's converter keeps only the encoder blocks LLaVA's feature
layer uses and no post-layernorm), "idefics3" (Idefics3 / SmolVLM: SigLIP + pixel
shuffle + one linear) and "gemma3" (Gemma 3: SigLIP + average pool by the scale factor,
default 4, + Gemma's RMSNorm, stored as 1 + w, + a bare [vision, text] projection).
`read_mmproj` returns the facts and the tensors (float32) under the HF model's own
parameter names; every key is bounded and every tensor's shape is checked against the
keys before a byte is decoded, so a hostile file is a ModelLoadError by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.gguf_file import GGUFFile, GGUFTensor, MetadataArray
from services.common.model_errors import ModelLoadError

PROJECTORS = {"mlp": "LLaVA", "idefics3": "Idefics3 / SmolVLM", "gemma3": "Gemma 3"}
# The scale factor a projector type has when the file states none (llama.cpp's: Gemma 3
# pools 4 x 4 patches into one soft token, 64 x 64 patches -> 256 tokens in the real 4B).
DEFAULT_SCALE = {"gemma3": 4}
# Each projector type's first tensor and which of its dimensions is the text width.
PROJECTION = {
    "mlp": ("mm.0.weight", 0),
    "idefics3": ("mm.model.fc.weight", 0),
    "gemma3": ("mm.input_projection.weight", 1),
}
# Bounds on what the keys may state (real encoders: 224..896 pixels, 12..32 blocks of
# width 768..1280, 12..16 heads; SmolVLM's pixel shuffle: 2..4).
MAX_IMAGE_SIZE = 4096
MAX_WIDTH = 1 << 16
MAX_BLOCKS = 256
MAX_SCALE_FACTOR = 16
_FLOAT32_ARRAY = 6  # GGUF's value type of a float32 (image_mean / image_std items)
_INT_ARRAYS = (4, 5)  # uint32, int32 (clip.vision.feature_layer)
_FLOAT_DTYPES = {"F32": "<f4", "F16": "<f2"}


@dataclass(frozen=True)
class VisionFacts:
    """An mmproj file's hyperparameters, checked against its bounds."""

    projector: str  # PROJECTORS
    image_size: int  # the encoder's square input, pixels
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # the encoder blocks the file holds (and the features run through)
    num_heads: int
    layer_norm_eps: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    use_gelu: bool  # GELU (tanh); else CLIP's quick GELU
    scale_factor: int  # idefics3's pixel shuffle, gemma3's pooling (1: none)
    longest_edge: int  # idefics3: an image is resized to at most this before tiling
    text_hidden_size: int  # the projector's output width

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass
class Mmproj:
    facts: VisionFacts
    tensors: dict  # HF parameter name -> torch.Tensor (float32)


def read_mmproj(path: str | Path) -> Mmproj:
    """The facts and tensors of an mmproj file (ModelLoadError naming what is wrong)."""
    gguf = GGUFFile(path)
    projector = _projector_type(gguf)
    by_name = {t.name: t for t in gguf.tensors}
    facts = _facts(gguf, projector, by_name)
    layout = _layout(facts, by_name, gguf.path)
    unknown = sorted(set(by_name) - {name for name, _ in layout.values()})
    if unknown:
        raise ModelLoadError(
            f"mmproj file {gguf.path}: tensors a {projector} projector does not have: "
            f"{', '.join(unknown[:6])}"
        )
    tensors = {hf: _decoded(gguf, by_name[name]) for hf, (name, _) in layout.items()}
    return Mmproj(facts, _with_unused_parts(facts, tensors))


# -- keys -------------------------------------------------------------------------------------


def _error(gguf: GGUFFile, problem: str) -> ModelLoadError:
    return ModelLoadError(f"mmproj file {gguf.path}: {problem}")


def _projector_type(gguf: GGUFFile) -> str:
    if gguf.architecture != "clip":
        raise _error(
            gguf,
            f"general.architecture is {gguf.architecture!r}, not 'clip': --mmproj takes "
            "llama.cpp's vision projector file (mmproj-*.gguf), the text model goes first",
        )
    meta = gguf.metadata
    projector = meta.get("clip.projector_type", meta.get("clip.vision.projector_type"))
    if projector is None and meta.get("clip.has_llava_projector") is True:
        projector = "mlp"  # the oldest LLaVA files name no type
    if projector not in PROJECTORS:
        known = ", ".join(f"{k} ({v})" for k, v in PROJECTORS.items())
        raise _error(
            gguf, f"projector type {projector!r} is not supported; pagestream reads {known}"
        )
    if meta.get("clip.has_vision_encoder", True) is not True:
        raise _error(gguf, "it holds no vision encoder (clip.has_vision_encoder is false)")
    return str(projector)


def _int(gguf: GGUFFile, key: str, low: int, high: int, default: int | None = None) -> int:
    value = gguf.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(
            gguf, f"{key} is {'missing' if value is None else repr(value)}; an integer is needed"
        )
    if not low <= value <= high:
        raise _error(gguf, f"{key} is {value}; it must lie in [{low}, {high}]")
    return value


def _eps(gguf: GGUFFile) -> float:
    value = gguf.metadata.get("clip.vision.attention.layer_norm_epsilon")
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise _error(
            gguf, f"clip.vision.attention.layer_norm_epsilon is {value!r}; (0, 1) is needed"
        )
    return _decimal(value)


def _decimal(value: float) -> float:
    """A float32 the file stores as the decimal it was written from (1e-05, not
    9.99999974e-06): numpy's shortest float32 spelling."""
    return float(str(np.float32(value)))


def _array(gguf: GGUFFile, key: str, types: tuple[int, ...], count: int | None) -> list | None:
    """A small metadata array's values (None when absent): its type and length checked on
    GGUFFile's entry before gguf's reader decodes it."""
    entry = gguf.metadata.get(key)
    if entry is None:
        return None
    if not isinstance(entry, MetadataArray) or entry.element_type not in types:
        raise _error(gguf, f"{key} is not an array of the expected value type")
    if (count is not None and entry.count != count) or not 0 < entry.count <= 64:
        raise _error(gguf, f"{key} holds {entry.count} values; {count or '1 to 64'} expected")
    from gguf import GGUFReader

    try:  # gguf's reader decodes what GGUFFile skipped (its strings strictly, as UTF-8)
        return list(GGUFReader(str(gguf.path)).fields[key].contents())
    except Exception as exc:  # a third-party parse of the user's file
        raise _error(gguf, f"{key} cannot be read ({type(exc).__name__}: {exc})") from exc


def _facts(gguf: GGUFFile, projector: str, by_name: dict[str, GGUFTensor]) -> VisionFacts:
    image_size = _int(gguf, "clip.vision.image_size", 1, MAX_IMAGE_SIZE)
    patch_size = _int(gguf, "clip.vision.patch_size", 1, image_size)
    hidden = _int(gguf, "clip.vision.embedding_length", 1, MAX_WIDTH)
    heads = _int(gguf, "clip.vision.attention.head_count", 1, hidden)
    layers = _int(gguf, "clip.vision.block_count", 1, MAX_BLOCKS)
    scale = _int(
        gguf,
        "clip.vision.projector.scale_factor",
        1,
        MAX_SCALE_FACTOR,
        default=DEFAULT_SCALE.get(projector, 1),
    )
    if image_size % patch_size or hidden % heads:
        raise _error(
            gguf,
            f"image_size {image_size} is not whole patches of {patch_size}, or width {hidden} "
            f"not whole heads of {heads}",
        )
    if (image_size // patch_size) % scale:
        raise _error(gguf, f"{image_size // patch_size} patches a side do not group by {scale}")
    if gguf.metadata.get("clip.vision.image_grid_pinpoints") is not None:
        raise _error(
            gguf, "LLaVA-NeXT's any-resolution tiling (image_grid_pinpoints) is not supported"
        )
    _check_feature_layer(gguf, layers)
    mean = _array(gguf, "clip.vision.image_mean", (_FLOAT32_ARRAY,), 3)
    std = _array(gguf, "clip.vision.image_std", (_FLOAT32_ARRAY,), 3)
    if mean is None or std is None or not all(s > 0 for s in std):
        raise _error(gguf, "clip.vision.image_mean / image_std must be 3 floats (std > 0)")
    name, text_dim = PROJECTION[projector]
    out = by_name.get(name)
    if out is None or len(out.shape) != 2:
        raise _error(gguf, f"the projector's first matrix ({name}) is missing")
    return VisionFacts(
        projector=projector,
        image_size=image_size,
        patch_size=patch_size,
        hidden_size=hidden,
        intermediate_size=_int(gguf, "clip.vision.feed_forward_length", 1, 1 << 20),
        num_layers=layers,
        num_heads=heads,
        layer_norm_eps=_eps(gguf),
        image_mean=tuple(_decimal(x) for x in mean),
        image_std=tuple(_decimal(x) for x in std),
        use_gelu=gguf.metadata.get("clip.use_gelu") is True,
        scale_factor=scale,
        longest_edge=_int(
            gguf, "clip.vision.preproc_image_size", image_size, 8 * MAX_IMAGE_SIZE, image_size
        ),
        text_hidden_size=out.shape[text_dim],
    )


def _check_feature_layer(gguf: GGUFFile, layers: int) -> None:
    """LLaVA's feature layer: llama.cpp's converter keeps the blocks up to it, so the one
    layer it may name is the file's last block (several layers, concatenated: refused)."""
    feature = _array(gguf, "clip.vision.feature_layer", _INT_ARRAYS, None)
    if feature is not None and [int(x) for x in feature] != [layers]:
        raise _error(
            gguf,
            f"clip.vision.feature_layer {feature} is not the file's last block ({layers}); "
            "features from other or several layers are not supported",
        )


# -- tensors -------------------------------------------------------------------------------------

# HF parameter name -> (the file's tensor name, the shape the keys give it)
Layout = dict[str, tuple[str, tuple[int, ...]]]


def _layout(facts: VisionFacts, by_name: dict[str, GGUFTensor], path: Path) -> Layout:
    """Every tensor the projector type needs, with the shape the keys give it; a missing
    one or one of another shape is an error naming it."""
    h, ff, t, p = (
        facts.hidden_size,
        facts.intermediate_size,
        facts.text_hidden_size,
        facts.patch_size,
    )
    n = facts.patches_per_side**2
    llava = facts.projector == "mlp"
    top = "model.vision_model." if facts.projector == "idefics3" else "model.vision_tower."
    layout: Layout = {
        top + "embeddings.patch_embedding.weight": ("v.patch_embd.weight", (h, 3, p, p)),
        # LLaVA's CLIP: one more position, the class token's
        top + "embeddings.position_embedding.weight": ("v.position_embd.weight", (n + llava, h)),
    }
    if llava:
        layout[top + "embeddings.class_embedding"] = ("v.class_embd", (h,))
        layout |= _norm(top + "pre_layrnorm", "v.pre_ln", h)
        layout["model.multi_modal_projector.linear_1.weight"] = ("mm.0.weight", (t, h))
        layout["model.multi_modal_projector.linear_1.bias"] = ("mm.0.bias", (t,))
        layout["model.multi_modal_projector.linear_2.weight"] = ("mm.2.weight", (t, t))
        layout["model.multi_modal_projector.linear_2.bias"] = ("mm.2.bias", (t,))
    else:  # SigLIP
        layout[top + "embeddings.patch_embedding.bias"] = ("v.patch_embd.bias", (h,))
        layout |= _norm(top + "post_layernorm", "v.post_ln", h)
    if facts.projector == "idefics3":
        fc = (t, h * facts.scale_factor**2)
        layout["model.connector.modality_projection.proj.weight"] = ("mm.model.fc.weight", fc)
    if facts.projector == "gemma3":
        projector = "model.multi_modal_projector."
        layout[projector + "mm_input_projection_weight"] = ("mm.input_projection.weight", (h, t))
        layout[projector + "mm_soft_emb_norm.weight"] = ("mm.soft_emb_norm.weight", (h,))
    for i in range(facts.num_layers):
        layout |= _block(f"{top}encoder.layers.{i}.", f"v.blk.{i}.", h, ff, by_name)
    for hf, (name, shape) in layout.items():
        tensor = by_name.get(name)
        if tensor is None:
            raise ModelLoadError(f"mmproj file {path}: tensor {name!r} ({hf}) is missing")
        if tensor.shape != shape:
            raise ModelLoadError(
                f"mmproj file {path}: tensor {name!r} has shape {list(tensor.shape)}; the "
                f"file's keys make it {list(shape)}"
            )
    return layout


def _norm(hf: str, gguf: str, width: int) -> Layout:
    return {f"{hf}.{k}": (f"{gguf}.{k}", (width,)) for k in ("weight", "bias")}


def _block(hf: str, gguf: str, h: int, ff: int, by_name: dict[str, GGUFTensor]) -> Layout:
    """One encoder block. llama.cpp's legacy CLIP converter wrote fc1 as ffn_down and fc2 as
    ffn_up; like llama.cpp, a ffn_down whose input is the block's width is read as fc1."""
    down = by_name.get(gguf + "ffn_down.weight")
    swapped = ff != h and down is not None and down.shape == (ff, h)
    up, down_name = ("ffn_down", "ffn_up") if swapped else ("ffn_up", "ffn_down")
    layout: Layout = {}
    for hf_name, name in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k")):
        layout[f"{hf}{hf_name}.weight"] = (f"{gguf}{name}.weight", (h, h))
        layout[f"{hf}{hf_name}.bias"] = (f"{gguf}{name}.bias", (h,))
    for hf_name, name in (("self_attn.v_proj", "attn_v"), ("self_attn.out_proj", "attn_out")):
        layout[f"{hf}{hf_name}.weight"] = (f"{gguf}{name}.weight", (h, h))
        layout[f"{hf}{hf_name}.bias"] = (f"{gguf}{name}.bias", (h,))
    layout[hf + "mlp.fc1.weight"] = (f"{gguf}{up}.weight", (ff, h))
    layout[hf + "mlp.fc1.bias"] = (f"{gguf}{up}.bias", (ff,))
    layout[hf + "mlp.fc2.weight"] = (f"{gguf}{down_name}.weight", (h, ff))
    layout[hf + "mlp.fc2.bias"] = (f"{gguf}{down_name}.bias", (h,))
    layout |= _norm(hf + "layer_norm1", gguf + "ln1", h)
    layout |= _norm(hf + "layer_norm2", gguf + "ln2", h)
    return layout


def _decoded(gguf: GGUFFile, tensor: GGUFTensor):
    """The tensor as float32 torch, in its torch-order shape (F32 / F16 / BF16 read as
    they are, block formats through gguf's de-quantizer)."""
    import torch

    raw = gguf.raw(tensor)
    if tensor.type_name in _FLOAT_DTYPES:
        values = raw.view(_FLOAT_DTYPES[tensor.type_name]).astype(np.float32)
    elif tensor.type_name == "BF16":
        values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        values = _dequantized(gguf, tensor, raw)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(tensor.shape))


def _dequantized(gguf: GGUFFile, tensor: GGUFTensor, raw: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        return dequantize(raw, GGMLQuantizationType[tensor.type_name]).astype(np.float32)
    except (KeyError, NotImplementedError) as exc:
        raise _error(
            gguf, f"tensor {tensor.name!r} is {tensor.type_name}, which cannot be decoded"
        ) from exc


def _with_unused_parts(facts: VisionFacts, tensors: dict) -> dict:
    """LLaVA's CLIP has a post-layernorm its features never pass through (they are the
    last kept block's output), which llama.cpp's converter leaves out: the identity here.
    Gemma 3's soft-embedding norm scales by 1 + w, which the file stores as 1 + w."""
    if facts.projector == "gemma3":
        tensors["model.multi_modal_projector.mm_soft_emb_norm.weight"] -= 1.0
    if facts.projector == "mlp":
        import torch

        tensors["model.vision_tower.post_layernorm.weight"] = torch.ones(facts.hidden_size)
        tensors["model.vision_tower.post_layernorm.bias"] = torch.zeros(facts.hidden_size)
    return tensors
