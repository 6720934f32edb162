"""Gemma 3's image tokens attend to their whole image, as HF's Gemma3ForConditionalGeneration
with token_type_ids (the processor's): logits of a two-image prompt, whole and chunked at
an image's start, and of a decode step after it, equal HF's (float32) on the torch
modules and the native step, sliding-window layers included. The rows' key limits come
from the worker's own image_slices and image_key_limits, as the InputBatch builds them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.config import ModelConfig
from services.common.image_input import ImageInput
from services.worker.input_batch import InputBatch
from services.worker.model_loader import load_model
from services.worker.multimodal.image_key_limits import image_key_limits, run_ends
from services.worker.multimodal.image_slice import image_slices
from tests.helpers.paged_session import PagedSession, SeqState
from tests.helpers.scheduler_plans import new_req, plan

ATOL = 1e-4
IMAGE, BOI, EOI = 299, 297, 298
# two images of 4 tokens each (positions 8..11 and 15..18), text around them
PROMPT = [5, 40, 7, 11, 13, 17, 19, BOI, *[IMAGE] * 4, EOI, 61, BOI, *[IMAGE] * 4, EOI, 90, 33]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    """A tiny Gemma 3 with images: a sliding-window layer (window 6: the image rows' own
    windows cut the keys before them) and a full-attention one."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    from tests.helpers.tiny_vlms import TEXT_SIZES, VISION_SIZES

    torch.manual_seed(0)
    text = Gemma3TextConfig(
        vocab_size=300,
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        **TEXT_SIZES,
    )
    vision = SiglipVisionConfig(image_size=32, patch_size=8, vision_use_head=False, **VISION_SIZES)
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
    )
    folder = tmp_path_factory.mktemp("gemma3-bidirectional")
    Gemma3ForConditionalGeneration(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_dir):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(gemma3_dir, dtype=torch.float32).eval()


def hf_logits(hf, ids: list[int], pixels: torch.Tensor, bidirectional=True) -> torch.Tensor:
    """[T, vocab]; token_type_ids (1 on image tokens) make HF's image tokens attend both ways."""
    input_ids = torch.tensor([ids])
    types = (input_ids == IMAGE).long() if bidirectional else None
    with torch.no_grad():
        out = hf(input_ids=input_ids, pixel_values=pixels, token_type_ids=types)
    return out.logits[0]


def images_of(ids: list[int], pixels: torch.Tensor) -> tuple[ImageInput, ...]:
    """Each run of image tokens as the frontend hands it over, its pixels as numpy."""
    is_image = np.array(ids) == IMAGE
    starts = np.flatnonzero(is_image & ~np.r_[False, is_image[:-1]])
    return tuple(
        ImageInput(int(s), 4, 4, f"image{i}", {"pixel_values": pixels[i : i + 1].numpy()})
        for i, s in enumerate(starts)
    )


def run_chunks(model, ids: list[int], pixels: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Our logits of `ids` computed in steps of `chunks` tokens, each step's image rows
    spliced in and its rows' key limits set as the InputBatch sets them: [T, vocab]."""
    images = images_of(ids, pixels)
    token_row = np.array(ids)
    embeds = model.embed(torch.tensor(ids))  # [T, hidden]
    embeds[torch.tensor(ids) == IMAGE] = torch.cat([model.encode_image(i) for i in images])
    session, seq = PagedSession(model), SeqState(list(ids))
    logits = []
    for num in chunks:
        start = seq.num_computed_tokens
        input_ids, positions, metadata = session.build_step([(seq, num)])
        slices = image_slices("r", images, token_row, start, num, 0, IMAGE)
        limits = image_key_limits(
            positions.numpy(), np.full(num, start + num), slices, {"r": token_row}, IMAGE
        )
        metadata = replace(metadata, key_limits=torch.from_numpy(limits))
        with torch.no_grad():
            hidden = model(
                input_ids,
                positions,
                session.kv_caches,
                metadata,
                inputs_embeds=embeds[start : start + num],
            )
            logits.append(model.compute_logits(hidden))
        seq.num_computed_tokens += num
    return torch.cat(logits)


def test_run_ends():
    is_image = np.array([0, 1, 1, 0, 1, 1, 1, 0, 0, 1], dtype=bool)
    assert run_ends(is_image).tolist() == [0, 3, 3, 3, 7, 7, 7, 7, 8, 10]


def test_hf_image_tokens_attend_both_ways(hf_gemma3):
    """The comparison below is not vacuous: HF's token_type_ids change the logits of the
    image tokens but each image's last (by far more than ATOL; the later rows' change
    less in this tiny model) and of no row before the first image."""
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    both_ways = hf_logits(hf_gemma3, PROMPT, pixels)
    causal = hf_logits(hf_gemma3, PROMPT, pixels, bidirectional=False)
    change = (both_ways - causal).abs().amax(dim=-1)  # [T]
    assert torch.equal(change[:8], torch.zeros(8))
    assert (change[8:11] > 1e-2).all() and (change[15:18] > 1e-2).all()


@pytest.mark.parametrize("chunks", [[len(PROMPT)], [8, len(PROMPT) - 8]], ids=["whole", "chunked"])
@pytest.mark.parametrize("eager", [False, True], ids=["native", "torch"])
def test_logits_with_images_equal_hf_bidirectional(gemma3_dir, hf_gemma3, eager, chunks):
    model = load_model(
        ModelConfig(model=str(gemma3_dir), dtype="float32", enforce_eager=eager), device="cpu"
    )
    assert (model.model.native is None) == eager and model.bidirectional_images
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    reference = hf_logits(hf_gemma3, PROMPT, pixels)
    token = int(reference[-1].argmax())
    ids = [*PROMPT, token]
    # the prompt in `chunks`, then one decode step of the greedy token
    ours = run_chunks(model, ids, pixels, [*chunks, 1])
    next_reference = hf_logits(hf_gemma3, ids, pixels)[-1:]
    torch.testing.assert_close(ours[:-1], reference, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours[-1:], next_reference, atol=ATOL, rtol=0)


def test_the_triton_backend_is_refused(gemma3_dir):
    from services.worker.layers.attention import AttentionOps

    model = load_model(
        ModelConfig(model=str(gemma3_dir), dtype="float32", enforce_eager=True), device="cpu"
    )
    triton = AttentionOps("triton", lambda *a: None, lambda *a: None)
    with pytest.raises(ValueError, match="attends bidirectionally within each image"):
        model.set_attention_ops(triton)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_input_batch_sets_key_limits_for_a_bidirectional_model(bidirectional):
    """A text-only request beside one with two images: the image tokens' rows see their
    image's end, every other row its own position + 1; without the flag, no limits."""
    batch = InputBatch(4, 4, 32, 300, 2, "cpu", image_token_id=IMAGE)
    batch.bidirectional_images = bidirectional
    images = images_of(PROMPT, torch.zeros(2, 3, 32, 32))
    step = plan(
        {"text": 3, "image": len(PROMPT)},
        new=[
            new_req("text", [5, 6, 7], [0]),
            replace(new_req("image", PROMPT, [1, 2, 3, 4, 5, 6]), images=images),
        ],
    )
    batch.update(step)
    inputs = batch.prepare(step)
    if not bidirectional:
        assert inputs.key_limits is None
        return
    # the images' tokens sit at positions 8..11 and 15..18
    limits = [12 if 8 <= p < 12 else 19 if 15 <= p < 19 else p + 1 for p in range(len(PROMPT))]
    assert inputs.key_limits.dtype == torch.int32
    assert inputs.key_limits.tolist() == [1, 2, 3, *limits]
    assert torch.equal(inputs.attention_metadata().key_limits, inputs.key_limits)


@pytest.fixture(scope="module")
def gemma3_chat_dir(tmp_path_factory) -> Path:
    """The tiny Gemma 3 above with its tokenizer and HF processor (the frontend's
    test folder's, tests/frontend/test_image_inputs.py), weights saved."""
    from transformers import Gemma3ForConditionalGeneration

    from tests.helpers.tiny_vlms import build_gemma3_processor_folder

    folder = build_gemma3_processor_folder(tmp_path_factory.mktemp("gemma3-chat"))
    config = Gemma3ForConditionalGeneration.config_class.from_pretrained(folder)
    config.vision_config.vision_use_head = False
    config.text_config.sliding_window = 6
    config.text_config.layer_types = ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).eval().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("budget", [None, 24], ids=["whole", "chunked"])
def test_llm_generate_with_an_image_equals_hf_generate(gemma3_chat_dir, budget):
    """LLM.generate with two images: greedy tokens equal HF generate's (the processor's
    token_type_ids) and the prompt's logprobs HF's (those of the image tokens are where
    attending both ways shows in this tiny model); with a 24-token step budget the prompt
    is chunked around the images."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    from pagestream import LLM, SamplingParams
    from tests.helpers.tiny_vlms import random_image

    text = "look: <start_of_image> what is it? then <start_of_image> and this one?"
    images = [random_image(3, (40, 30)), random_image(4, (30, 40))]
    processor = AutoProcessor.from_pretrained(gemma3_chat_dir)
    inputs = processor(text=text, images=images, return_tensors="pt")
    ids = inputs["input_ids"][0]
    assert inputs["token_type_ids"].sum() == 8  # two images of 4 soft tokens
    hf = Gemma3ForConditionalGeneration.from_pretrained(gemma3_chat_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = hf.eval().generate(**inputs, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        logprobs = hf(**inputs).logits[0].log_softmax(-1)  # [T, vocab]
    expected_prompt = logprobs[:-1].gather(1, ids[1:, None])[:, 0]  # [T - 1]
    options = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = LLM(str(gemma3_chat_dir), dtype="float32", kv_cache_memory="16MiB", **options)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.prompt_token_ids == ids.tolist()
    assert out.outputs[0].token_ids == expected[0, len(ids) :].tolist()
    ours = torch.tensor(
        [p[t].logprob for p, t in zip(out.prompt_logprobs[1:], ids[1:].tolist(), strict=True)]
    )
    torch.testing.assert_close(ours, expected_prompt, atol=ATOL, rtol=0)
