"""Qwen2.5-VL's worker side equals HF transformers (float32) on a tiny random folder
(tests/helpers/tiny_vlms.py): encode_image is HF's get_image_features (windowed and full
attention layers, 2D rotary, patch merger), the M-RoPE positions are HF's get_rope_index,
the M-RoPE rotary table is HF's, and the text model fed the image rows at those
positions gives HF's logits for the prompt and for decode steps after it (native CPU
step and torch modules)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

from services.common.config import ModelConfig
from services.common.image_input import ImageInput
from services.worker.layers.rotary_embedding import MRotaryEmbedding, RotaryEmbedding
from services.worker.model_loader import load_model
from services.worker.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from services.worker.models.vision.vision_windows import patch_groups
from services.worker.multimodal.mrope_positions import (
    mrope_positions,
    prompt_mrope_positions,
    rope_positions,
)
from tests.helpers.paged_session import PagedSession, SeqState
from tests.helpers.tiny_vlms import build_tiny_vlm, expand_qwen2_5_vl_pads, random_image

ATOL = 1e-4
# (width, height): grids (t, h, w) of 1 x 4 x 6, 1 x 2 x 12 (one row of windows), 1 x 12 x
# 12 (3 x 3 windows of 2 x 2 merged tokens) and 1 x 10 x 14 (windows cut at the edges)
SIZES = [(50, 40), (90, 20), (200, 200), (110, 80)]
PROMPT = "<s>user: <|vision_start|><|image_pad|><|vision_end|>what is this?\n<s>assistant:"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("vlm-qwen2_5_vl"))


@pytest.fixture(scope="module")
def hf(folder):
    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def image_processor(folder):
    return Qwen2VLImageProcessorPil.from_pretrained(folder)


def load(folder: Path, **options):
    return load_model(ModelConfig(model=str(folder), dtype="float32", **options), device="cpu")


def processed(folder, image_processor, sizes, seed=1) -> dict[str, torch.Tensor]:
    """The prompt with one image marker per size, expanded as HF's processor does."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    text = PROMPT.replace(marker, marker * len(sizes))
    images = [random_image(seed + i, size) for i, size in enumerate(sizes)]
    pixels = image_processor(images=images, return_tensors="pt")
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = expand_qwen2_5_vl_pads(
        tokenizer.encode(text), pad, pixels["image_grid_thw"].tolist(), merge=2
    )
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == pad).int(),
        **pixels,
    }


def image_inputs(model, inputs: dict[str, torch.Tensor]) -> list[ImageInput]:
    """Each image as the frontend hands it over: its run of pads, its own patches and
    image_grid_thw [1, 3]."""
    ids = inputs["input_ids"][0]
    is_pad = (ids == model.image_token_id).int()
    starts = (torch.diff(is_pad, prepend=torch.tensor([0])) == 1).nonzero().flatten().tolist()
    grids = inputs["image_grid_thw"]
    first = 0
    images = []
    for start, grid in zip(starts, grids, strict=True):
        patches = int(grid.prod())
        rows = patches // 4
        data = {
            "pixel_values": inputs["pixel_values"][first : first + patches].numpy(),
            "image_grid_thw": grid[None].numpy(),
        }
        images.append(ImageInput(start, rows, rows, f"hash{start}", data))
        first += patches
    return images


@pytest.mark.parametrize("size", SIZES)
def test_encode_image_equals_hf(size, folder, hf, image_processor):
    model = load(folder)
    assert type(model) is Qwen2_5_VLForConditionalGeneration
    inputs = processed(folder, image_processor, [size])
    (image,) = image_inputs(model, inputs)
    rows = model.encode_image(image)
    with torch.no_grad():
        (reference,) = hf.get_image_features(
            pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
        ).pooler_output
    assert rows.dtype == torch.float32 and rows.shape == reference.shape == (image.num_embeds, 64)
    torch.testing.assert_close(rows, reference, atol=1e-5, rtol=0)


def test_patch_groups_cover_each_patch_once():
    """Windows of 2 x 2 merged tokens over a 3 x 5 merged grid: 2 x 3 windows, the last
    row and column cut; each frame whole for full attention."""
    windows = patch_groups((1, 6, 10), merge=2, window=2)
    sizes = sorted(size for batch in windows for size in [batch.shape[1]] * batch.shape[0])
    assert sizes == [4, 8, 8, 8, 16, 16]
    covered = torch.cat([batch.flatten() for batch in windows]).sort().values
    assert torch.equal(covered, torch.arange(60))
    (frames,) = patch_groups((2, 4, 4), merge=2, window=None)
    assert frames.shape == (2, 16) and torch.equal(frames[1], torch.arange(16, 32))


def test_mrope_positions_equal_hf_get_rope_index(folder, hf, image_processor):
    model = load(folder, enforce_eager=True)
    inputs = processed(folder, image_processor, SIZES[:3])
    with torch.no_grad():
        reference, delta = hf.model.get_rope_index(
            inputs["input_ids"],
            inputs["mm_token_type_ids"],
            image_grid_thw=inputs["image_grid_thw"],
        )
    images = image_inputs(model, inputs)
    positions, ours = prompt_mrope_positions(images, inputs["input_ids"].shape[1], merge=2)
    np.testing.assert_array_equal(positions, reference[:, 0].numpy())
    assert ours == int(delta) < 0
    # past the prompt: index + delta on all three axes
    index = np.array([3, positions.shape[1], positions.shape[1] + 4])
    expected = np.stack([positions[:, 3], [positions.shape[1] + ours] * 3, [index[2] + ours] * 3])
    np.testing.assert_array_equal(rope_positions(index, positions, ours), expected.T)


def test_mrope_positions_refuse_a_span_that_is_not_its_grid():
    with pytest.raises(ValueError, match="merged patches"):
        mrope_positions(20, [(2, 5, (1, 4, 4))], merge=2)
    with pytest.raises(ValueError, match="past the prompt"):
        mrope_positions(5, [(2, 4, (1, 4, 4))], merge=2)
    bad = ImageInput(0, 4, 4, "h", {"image_grid_thw": np.array([[1.0, 4.0, 4.0]])})
    with pytest.raises(ValueError, match="image_grid_thw"):
        prompt_mrope_positions([bad], 8, merge=2)


def test_mrope_rotary_equals_hf(hf):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    config = hf.config.get_text_config()
    rotary = RotaryEmbedding.from_config(config, 16)
    assert isinstance(rotary, MRotaryEmbedding)
    positions = torch.randint(0, 500, (3, 11), generator=torch.Generator().manual_seed(0))
    cos, sin = rotary.cos_sin(positions)
    x = torch.zeros(1, 11, 16)
    ref_cos, ref_sin = Qwen2_5_VLRotaryEmbedding(config)(x, positions[:, None, :])
    torch.testing.assert_close(cos[:, 0], ref_cos[0], atol=0, rtol=0)
    torch.testing.assert_close(sin[:, 0], ref_sin[0], atol=0, rtol=0)
    text = positions[0]  # [T]: the three axes equal
    torch.testing.assert_close(rotary.cos_sin(text)[0], rotary.cos_sin(text.expand(3, -1))[0])
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding(16, rotary.inv_freq, 1.0, [2, 3, 4])


def spliced_logits(model, inputs: dict[str, torch.Tensor], decode_tokens: list[int]):
    """Our logits for the prompt with its image rows spliced in at its M-RoPE positions
    (one step), then for one decode step per token of `decode_tokens` at index + delta:
    ([T, vocab], [[1, vocab], ...])."""
    ids = inputs["input_ids"][0]
    embeds = model.embed(ids)  # [T, hidden]
    images = image_inputs(model, inputs)
    for image in images:
        embeds[image.offset : image.end] = model.encode_image(image)
    table, delta = prompt_mrope_positions(images, len(ids), model.mrope_merge_size)
    session = PagedSession(model)
    seq = SeqState(ids.tolist())
    input_ids, kv_index, metadata = session.build_step([(seq, len(ids))])
    positions = torch.from_numpy(rope_positions(kv_index.numpy(), table, delta))  # [3, T]
    with torch.no_grad():
        hidden = model(input_ids, positions, session.kv_caches, metadata, inputs_embeds=embeds)
        prompt_logits = model.compute_logits(hidden)
    decode_logits = []
    for token in decode_tokens:
        seq.num_computed_tokens = len(seq.token_ids)
        seq.token_ids.append(token)
        input_ids, kv_index, metadata = session.build_step([(seq, 1)])
        positions = torch.from_numpy(rope_positions(kv_index.numpy(), table, delta))
        with torch.no_grad():
            hidden = model(input_ids, positions, session.kv_caches, metadata)
            decode_logits.append(model.compute_logits(hidden))
    return prompt_logits, decode_logits


@pytest.mark.parametrize("eager", [False, True], ids=["native", "torch"])
def test_logits_with_images_equal_hf(eager, folder, hf, image_processor):
    """Two images (one cut into windows at its edges), then three greedy decode steps:
    each step's logits equal HF's forward over the whole sequence so far."""
    model = load(folder, enforce_eager=eager)
    assert (model.model.native is None) == eager  # the native step runs the text model
    inputs = processed(folder, image_processor, [SIZES[1], SIZES[3]], seed=2)
    with torch.no_grad():
        reference = hf(**inputs).logits[0]
    tokens, longer = [], dict(inputs)
    next_references = [reference[-1:]]
    for _ in range(3):
        tokens.append(int(next_references[-1][-1].argmax()))
        ids = torch.cat([inputs["input_ids"], torch.tensor([tokens])], dim=1)
        longer.update(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=torch.cat(
                [inputs["mm_token_type_ids"], torch.zeros(1, len(tokens), dtype=torch.int32)], 1
            ),
        )
        with torch.no_grad():
            next_references.append(hf(**longer).logits[0, -1:])
    prompt_logits, decode_logits = spliced_logits(model, inputs, tokens)
    torch.testing.assert_close(prompt_logits, reference, atol=ATOL, rtol=0)
    for ours, theirs in zip(decode_logits, next_references[1:], strict=True):
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_bad_image_tensors_are_value_errors(folder, image_processor):
    model = load(folder, enforce_eager=True)
    (image,) = image_inputs(model, processed(folder, image_processor, [SIZES[0]]))
    with pytest.raises(ValueError, match="placeholder holds"):
        model.encode_image(replace(image, num_embeds=image.num_embeds + 1))
    with pytest.raises(ValueError, match="no 'image_grid_thw'"):
        model.encode_image(replace(image, data={"pixel_values": image.data["pixel_values"]}))
    pixels = image.data["pixel_values"]
    with pytest.raises(ValueError, match="pixel_values must be"):
        model.encode_image(replace(image, data={**image.data, "pixel_values": pixels[:-1]}))
    odd = np.array([[1, 3, 6]])
    with pytest.raises(ValueError, match="merge blocks"):
        model.encode_image(replace(image, data={**image.data, "image_grid_thw": odd}))
    with pytest.raises(ValueError, match=r"\[1, 3\] integers"):
        model.encode_image(replace(image, data={**image.data, "image_grid_thw": odd[0]}))
