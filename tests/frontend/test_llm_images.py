"""LLM with images, each tiny VLM family: generate's multi_modal_data and chat's image parts
give HF generate's greedy tokens for the same image (float32); the image options are
LLM's keywords, and a bad image is a ValueError naming it."""

from __future__ import annotations

import base64
import io

import pytest

from pagestream import LLM
from services.common.sampling_params import SamplingParams
from tests.helpers.tiny_vlms import FAMILIES, build_tiny_vlm, random_image

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
PROMPT = "describe <image> now"
IMAGE = random_image(5, (60, 45))


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory):
    return build_tiny_vlm(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(
        str(folder), kv_cache_memory="8MiB", dtype="float32", limit_mm_per_prompt={"image": 1}
    )


def hf_tokens(folder, text: str, images: list) -> list[int]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0][inputs["input_ids"].shape[1] :].tolist()


def test_generate_and_chat_equal_hf_generate(llm, folder):
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": IMAGE}}
    (output,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert list(output.outputs[0].token_ids) == hf_tokens(folder, PROMPT, [IMAGE])
    url = "data:image/png;base64," + base64.b64encode(_png(IMAGE)).decode()
    parts = [{"type": "text", "text": "what? "}, {"type": "image_url", "image_url": {"url": url}}]
    (reply,) = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    text = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [parts[0], {"type": "image"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert list(reply.outputs[0].token_ids) == hf_tokens(folder, text, [IMAGE])


def test_bad_images_are_value_errors(llm):
    two = {"prompt": PROMPT + PROMPT, "multi_modal_data": {"image": [IMAGE, IMAGE]}}
    with pytest.raises(ValueError, match="more than the limit of 1"):
        llm.generate(two, GREEDY, use_tqdm=False)
    bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]
    with pytest.raises(ValueError, match="base64 is not valid"):
        llm.chat([{"role": "user", "content": bad}], GREEDY, use_tqdm=False)
    no_marker = {"prompt": "no marker", "multi_modal_data": {"image": IMAGE}}
    with pytest.raises(ValueError, match="0 image marker"):
        llm.generate(no_marker, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
