"""Qwen2.5-VL's worker side equals HF transformers (float32) on a tiny random folder
(tests/helpers/tiny_vlms.py): encode_image is HF's get_image_features (windowed and full
attention layers, 2D rotary, patch merger), the M-RoPE positions are HF's get_rope_index,
the M-RoPE rotary table is HF's, and the text model fed the image rows at those
positions gives HF's logits for the prompt and for decode steps after it (native CPU
step and torch modules). Through the engine: the InputBatch's [3, T] positions by chunk,
and LLM.generate with images equal to HF generate (alone, chunked through images,
preempted)."""

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


def prompt_images(sizes, seed=1, prompt=PROMPT):
    """(the prompt with one image marker per size, the images of seeds seed, seed + 1, ..)."""
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    text = prompt.replace(marker, marker * len(sizes))
    return text, [random_image(seed + i, size) for i, size in enumerate(sizes)]


def processed(folder, image_processor, sizes, seed=1, prompt=PROMPT) -> dict[str, torch.Tensor]:
    """The prompt with one image marker per size, expanded as HF's processor does."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text, images = prompt_images(sizes, seed, prompt)
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


CASES = [([SIZES[0]], 1), ([SIZES[1], SIZES[3]], 2)]  # (image sizes, first seed)
TEXT_ONLY = [5, 17, 120, 33, 250, 8, 64, 99, 3]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hf_greedy(folder, hf, image_processor):
    """HF generate's greedy tokens and their logprobs for CASES and TEXT_ONLY."""
    references = [processed(folder, image_processor, sizes, seed) for sizes, seed in CASES]
    references.append({"input_ids": torch.tensor([TEXT_ONLY])})
    results = []
    for inputs in references:
        with torch.no_grad():
            out = hf.generate(
                **inputs,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                min_new_tokens=MAX_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        logprobs = torch.stack(out.logits)[:, 0].log_softmax(-1)  # [MAX_TOKENS, vocab]
        chosen = logprobs[torch.arange(MAX_TOKENS), torch.tensor(tokens)]
        results.append((inputs["input_ids"][0].tolist(), tokens, chosen))
    return results


def _kv_bytes(blocks: int) -> int:
    """Bytes of `blocks` KV blocks of 4 tokens (2 layers, 2 KV heads of 16, float32)."""
    return blocks * 4 * 2 * 2 * 2 * 16 * 4


ENGINES = {
    "one-step": {},
    # chunks of 8 tokens: every image span (6 and 35 pads) cut by chunk ends
    "chunked": {"max_num_batched_tokens": 8, "max_model_len": 256},
    # room for the longest sequence and a few blocks: the others are preempted
    "preempted": {
        "block_size": 4,
        "kv_cache_memory": _kv_bytes(24),
        "preemption_mode": "recompute",
        "max_num_batched_tokens": 16,
        "max_model_len": 88,
    },
}


@pytest.mark.parametrize("engine", ENGINES)
def test_llm_generates_with_images_as_hf(engine, folder, hf_greedy):
    """LLM.generate with images (the frontend's processor, the worker's M-RoPE positions
    and encoder splice): one image, two images, and a text-only prompt in one batch,
    each equal to HF generate's greedy tokens and their logprobs (which the positions
    move where the tiny model's argmax might not)."""
    from pagestream import LLM, SamplingParams

    options = {"kv_cache_memory": "16MiB", "block_size": 16, **ENGINES[engine]}
    llm = LLM(str(folder), dtype="float32", **options)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    prompts = []
    for sizes, seed in CASES:
        text, images = prompt_images(sizes, seed)
        prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
    outs = llm.generate([*prompts, {"prompt_token_ids": TEXT_ONLY}], params, use_tqdm=False)
    for out, (prompt_ids, tokens, theirs) in zip(outs, hf_greedy, strict=True):
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
        chosen = zip(out.outputs[0].logprobs, tokens, strict=True)
        ours = torch.tensor([step[token].logprob for step, token in chosen])
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    if engine == "preempted":
        assert llm.engine.scheduler.num_preemptions > 0
    assert len(llm.engine.worker.runner.encoder_cache) == 0


def test_input_batch_gives_mrope_positions_by_chunk(folder, image_processor):
    """A prompt with two images prefilled in chunks that cut through the second image,
    batched with a text-only request, then a decode step: each row's [3, T] positions
    are its prompt's table (index + delta past it); the KV slots stay the indices."""
    from services.worker.input_batch import InputBatch
    from tests.helpers.scheduler_plans import new_req, plan

    model = load(folder, enforce_eager=True)
    inputs = processed(folder, image_processor, [SIZES[1], SIZES[3]])
    images = tuple(image_inputs(model, inputs))
    ids = inputs["input_ids"][0].tolist()
    table, delta = prompt_mrope_positions(images, len(ids), merge=2)
    batch = InputBatch(16, 4, 128, 512, None, "cpu", image_token_id=model.image_token_id)
    batch.mrope_merge_size = 2
    request = replace(new_req("img", ids, range(6)), images=images)
    text = new_req("txt", [5, 6, 7, 8], [7])
    first = images[1].offset + 3  # inside the second image
    steps = [
        plan({"img": first, "txt": 4}, new=[request, text]),
        plan({"img": len(ids) - first}, cached=[("img", [], first, False)]),
    ]
    expected = [
        np.concatenate([table[:, :first], np.tile(np.arange(4), (3, 1))], axis=1),
        table[:, first:],
    ]
    for step, want in zip(steps, expected, strict=True):
        batch.update(step)
        prepared = batch.prepare(step)
        np.testing.assert_array_equal(prepared.positions.numpy(), want)
    batch.append_sampled(["img"], [[9]])
    decode = plan({"img": 1}, cached=[("img", [], len(ids), False)])
    batch.update(decode)
    prepared = batch.prepare(decode)
    assert prepared.positions.tolist() == [[len(ids) + delta]] * 3
    assert prepared.slot_mapping[0].tolist() == [len(ids)]  # block 0 of its table


def test_merged_patch_processor_expands_pads(folder, image_processor):
    """The frontend's Qwen2.5-VL processor (HF's needs torchvision) expands each pad to
    its image's merged patches, as the tests' reference does; a count mismatch is a
    ValueError; another family's folder is not its."""
    from services.frontend.multimodal.merged_patch_processor import MergedPatchProcessor

    processor = MergedPatchProcessor.from_folder(folder)
    text, images = prompt_images([SIZES[0], SIZES[2]])
    out = processor(text=text, images=images, return_tensors="np")
    reference = processed(folder, image_processor, [SIZES[0], SIZES[2]])
    assert out["input_ids"].tolist() == reference["input_ids"].tolist()
    np.testing.assert_array_equal(out["image_grid_thw"], reference["image_grid_thw"].numpy())
    np.testing.assert_array_equal(out["pixel_values"], reference["pixel_values"].numpy())
    with pytest.raises(ValueError, match="image pads"):
        processor(text=text, images=images[:1])
    assert MergedPatchProcessor.from_folder(folder.parent) is None


def test_llm_chat_with_an_image_url_equals_hf(folder, hf, image_processor):
    """LLM.chat with an OpenAI-style image_url part (a PNG data URL) renders the folder's
    template around the image marker and generates HF's greedy tokens for that prompt."""
    import base64
    import io

    from pagestream import LLM, SamplingParams

    image = random_image(1, SIZES[0])
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "what is this?"},
    ]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)
    # the template's render of the parts (its trimmed blocks drop the line break)
    rendered = "<s>user: <|vision_start|><|image_pad|><|vision_end|>what is this?<s>assistant:"
    inputs = processed(folder, image_processor, [SIZES[0]], seed=1, prompt=rendered)
    with torch.no_grad():
        expected = hf.generate(
            **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
        )
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == expected[0, len(out.prompt_token_ids) :].tolist()
