"""The vision-language models' worker side equals HF transformers (float32) on tiny random
folders (tests/helpers/tiny_vlms.py): encode_image is HF's get_image_features, and the
text model fed embed(ids) with the image rows spliced in gives HF's logits for the prompt
and for a decode step after it (native CPU step and torch modules). The model runner
does that splice in the engine; here it is done by hand on one sequence."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from services.common.config import ModelConfig
from services.worker.model_loader import load_model
from services.worker.models.idefics3 import Idefics3ForConditionalGeneration
from services.worker.models.llava import LlavaForConditionalGeneration
from tests.helpers.paged_session import PagedSession, SeqState
from tests.helpers.tiny_vlms import FAMILIES, build_tiny_vlm
from tests.helpers.vlm_rows import hf_image_rows, image_input, processed

ATOL = 1e-4
CLASSES = {"llava": LlavaForConditionalGeneration, "idefics3": Idefics3ForConditionalGeneration}
# (width, height): a landscape photo, and a strip whose tiles' patches are partly padding
SIZES = [(50, 40), (90, 20)]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    folders: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in folders:
            folders[family] = build_tiny_vlm(family, tmp_path_factory.mktemp(f"vlm-{family}"))
        return folders[family]

    return get


@pytest.fixture(scope="module")
def hf_vlm(vlm_dir):
    """family -> (HF model in float32, its processor), loaded once."""
    loaded = {}

    def get(family: str):
        if family not in loaded:
            folder = vlm_dir(family)
            model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
            loaded[family] = (model.eval(), AutoProcessor.from_pretrained(folder))
        return loaded[family]

    return get


def load(folder: Path, **options):
    return load_model(ModelConfig(model=str(folder), dtype="float32", **options), device="cpu")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_encode_image_equals_hf(family, size, vlm_dir, hf_vlm):
    hf, processor = hf_vlm(family)
    model = load(vlm_dir(family))
    assert type(model) is CLASSES[family]
    inputs = processed(processor, size)
    rows = model.encode_image(image_input(model, inputs))
    reference = hf_image_rows(hf, inputs)
    assert rows.dtype == torch.float32 and rows.shape == reference.shape
    torch.testing.assert_close(rows, reference, atol=1e-5, rtol=0)


def test_idefics3_padding_patches_and_tiles_equal_hf(vlm_dir, hf_vlm):
    """Tiles padded as a batch pads them: the first tile's lower part masked out (its
    patches' positions bucketed, no layer's keys), and an all-zero tile, which HF drops."""
    hf, processor = hf_vlm("idefics3")
    model = load(vlm_dir("idefics3"))
    inputs = processed(processor)
    pixels, mask = inputs["pixel_values"].clone(), inputs["pixel_attention_mask"].clone()
    pixels[0, 0, :, 20:], mask[0, 0, 20:] = 0, 0  # 20 of 32 rows: a partly padded patch row
    pixels[0, 0, :, :, 24:], mask[0, 0, :, 24:] = 0, 0
    inputs["pixel_values"] = torch.cat([pixels, torch.zeros_like(pixels[:, :1])], dim=1)
    inputs["pixel_attention_mask"] = torch.cat([mask, torch.zeros_like(mask[:, :1])], dim=1)
    rows = model.encode_image(image_input(model, inputs))
    reference = hf_image_rows(hf, inputs)
    assert rows.shape == reference.shape == (image_input(model, inputs).num_embeds, 64)
    torch.testing.assert_close(rows, reference, atol=1e-5, rtol=0)


def spliced_logits(model, inputs: dict[str, torch.Tensor], decode_token: int):
    """Our logits for the prompt with its image rows spliced in (one step), then for one
    decode step of `decode_token` over the cache: ([T, vocab], [1, vocab])."""
    ids = inputs["input_ids"][0]
    embeds = model.embed(ids)  # [T, hidden]
    image = image_input(model, inputs)
    embeds[ids == model.image_token_id] = model.encode_image(image)
    session = PagedSession(model)
    seq = SeqState(ids.tolist())
    input_ids, positions, metadata = session.build_step([(seq, len(ids))])
    with torch.no_grad():
        hidden = model(input_ids, positions, session.kv_caches, metadata, inputs_embeds=embeds)
        prompt_logits = model.compute_logits(hidden)
    seq.num_computed_tokens = len(ids)
    seq.token_ids.append(decode_token)
    (decode_logits,) = session.step([(seq, 1)])
    return prompt_logits, decode_logits


@pytest.mark.parametrize("eager", [False, True], ids=["native", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_with_an_image_equal_hf(family, eager, vlm_dir, hf_vlm):
    hf, processor = hf_vlm(family)
    model = load(vlm_dir(family), enforce_eager=eager)
    assert (model.model.native is None) == eager  # the native step runs the text model
    inputs = processed(processor, SIZES[1], seed=2)
    with torch.no_grad():
        reference = hf(**inputs).logits[0]
    token = int(reference[-1].argmax())
    prompt_logits, decode_logits = spliced_logits(model, inputs, token)
    torch.testing.assert_close(prompt_logits, reference, atol=ATOL, rtol=0)
    longer = dict(inputs)
    longer["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[token]])], dim=1)
    longer["attention_mask"] = torch.ones_like(longer["input_ids"])
    with torch.no_grad():
        next_reference = hf(**longer).logits[0, -1:]
    torch.testing.assert_close(decode_logits, next_reference, atol=ATOL, rtol=0)


def test_embed_is_forwards_start(vlm_dir):
    """A forward fed embed(ids) as inputs_embeds gives the text-only forward's logits."""
    model = load(vlm_dir("llava"))
    ids = list(range(3, 20))
    plain = PagedSession(model).step([(SeqState(ids), len(ids))])[0]
    session = PagedSession(model)
    input_ids, positions, metadata = session.build_step([(SeqState(ids), len(ids))])
    embeds = model.embed(input_ids)
    assert embeds.dtype == torch.float32
    with torch.no_grad():
        hidden = model(input_ids, positions, session.kv_caches, metadata, inputs_embeds=embeds)
    torch.testing.assert_close(model.compute_logits(hidden), plain, atol=0, rtol=0)


TRANSFORMERS5_NAMES = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "model.vision_tower.vision_model."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


def test_llava_loads_either_weight_layout(vlm_dir, hf_vlm, tmp_path):
    """transformers 5 saves llava-hf's names (language_model.model.*, vision_tower.*); a
    checkpoint under the in-memory module names (model.language_model.*,
    model.vision_tower.vision_model.*) loads to the same model."""
    from safetensors.torch import load_file, save_file

    source = vlm_dir("llava")
    for path in source.iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    renamed = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        theirs, ours = next((t, o) for t, o in TRANSFORMERS5_NAMES if name.startswith(t))
        renamed[ours + name.removeprefix(theirs)] = tensor
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _, processor = hf_vlm("llava")
    inputs = processed(processor)
    first, second = load(source), load(tmp_path)
    image = image_input(first, inputs)
    torch.testing.assert_close(first.encode_image(image), second.encode_image(image))
    token = 5
    for a, b in zip(
        spliced_logits(first, inputs, token), spliced_logits(second, inputs, token), strict=True
    ):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_image_tensors_are_value_errors(family, vlm_dir, hf_vlm):
    _, processor = hf_vlm(family)
    model = load(vlm_dir(family))
    image = image_input(model, processed(processor))
    with pytest.raises(ValueError, match="placeholder holds"):
        model.encode_image(replace(image, num_embeds=image.num_embeds + 1))
    with pytest.raises(ValueError, match="no 'pixel_values'"):
        model.encode_image(replace(image, data={}))
    pixels = image.data["pixel_values"]
    with pytest.raises(ValueError, match="pixel_values"):
        model.encode_image(replace(image, data={**image.data, "pixel_values": pixels[0]}))
    too_big = pixels.repeat(2, axis=-1)  # twice the tower's width
    with pytest.raises(ValueError, match=r"pixels|tile"):
        model.encode_image(replace(image, data={"pixel_values": too_big}))
    if family == "idefics3":  # a tile with pixels but no pixel the mask keeps
        empty = image.data["pixel_attention_mask"].copy()
        empty[0, 1] = 0
        with pytest.raises(ValueError, match="mask keeps none"):
            model.encode_image(replace(image, data={**image.data, "pixel_attention_mask": empty}))
    with pytest.raises(ValueError, match="numeric"):
        model.encode_image(replace(image, data={"pixel_values": [["a"]]}))


@pytest.mark.parametrize("family", FAMILIES)
def test_llm_generates_text_only_prompts_as_hf(family, vlm_dir, hf_vlm):
    """The registry runs the folder natively: LLM(folder) builds, and a prompt without an
    image gives HF generate's greedy tokens (the image path is the engine's test)."""
    from pagestream import LLM, SamplingParams

    hf, _ = hf_vlm(family)
    prompt = [5, 17, 120, 33, 250, 8, 64, 99, 3]
    llm = LLM(str(vlm_dir(family)), dtype="float32", kv_cache_memory="16MiB", block_size=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8
        )[0, len(prompt) :]
    assert out.outputs[0].token_ids == expected.tolist()


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    """A tiny Gemma 3 with images (no processor: its pixel tensors are made here), its
    vision tower without SigLIP's pooling head, as the released checkpoints."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    from tests.helpers.tiny_vlms import TEXT_SIZES, VISION_SIZES

    torch.manual_seed(0)
    text = Gemma3TextConfig(vocab_size=300, head_dim=16, sliding_window=8, **TEXT_SIZES)
    vision = SiglipVisionConfig(image_size=32, patch_size=8, vision_use_head=False, **VISION_SIZES)
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,  # the 4 x 4 patches pooled 2 x 2
        image_token_index=299,
        boi_token_index=297,
        eoi_token_index=298,
    )
    folder = tmp_path_factory.mktemp("vlm-gemma3")
    Gemma3ForConditionalGeneration(config).eval().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("eager", [False, True], ids=["native", "torch"])
def test_gemma3_image_rows_and_causal_logits_equal_hf(gemma3_dir, eager):
    """encode_image is HF's get_image_features; with causal metadata built by hand (no
    key_limits) the prompt with its image spliced in gives HF's logits without
    token_type_ids, i.e. HF attending causally too. The engine's image tokens attend both
    ways as HF's do with token_type_ids: tests/worker/test_gemma3_image_attention.py."""
    from transformers import Gemma3ForConditionalGeneration as HFGemma3

    hf = HFGemma3.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    model = load(gemma3_dir, enforce_eager=eager)
    assert (model.model.native is None) == eager
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[5, 40, 7, 297, 299, 299, 299, 299, 298, 61, 12, 90]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}
    with torch.no_grad():
        reference_rows = hf.get_image_features(pixel_values=pixels).pooler_output.reshape(-1, 64)
        reference = hf(input_ids=ids, pixel_values=pixels).logits[0]
    rows = model.encode_image(image_input(model, inputs))
    torch.testing.assert_close(rows, reference_rows, atol=1e-5, rtol=0)
    token = int(reference[-1].argmax())
    prompt_logits, decode_logits = spliced_logits(model, inputs, token)
    torch.testing.assert_close(prompt_logits, reference, atol=ATOL, rtol=0)
    longer = torch.cat([ids, torch.tensor([[token]])], dim=1)
    with torch.no_grad():
        next_reference = hf(input_ids=longer, pixel_values=pixels).logits[0, -1:]
    torch.testing.assert_close(decode_logits, next_reference, atol=ATOL, rtol=0)
