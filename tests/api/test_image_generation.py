"""Images through the whole engine, each tiny VLM family, greedy tokens equal to HF
generate (float32): batched with text-only prompts, with chunked prefill cutting through
an image's span (the image larger than the step's encoder budget), under preemption by
recompute and by swap; prefix-cache hits on the same image and none past the text before
a different one; the encoder cache empty once the requests end."""

from __future__ import annotations

import pytest

from pagestream import LLM
from services.common.sampling_params import SamplingParams
from tests.helpers.tiny_vlms import FAMILIES, build_tiny_vlm, random_image

MAX_TOKENS = 5
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
CAT, DOG = random_image(1, (40, 52)), random_image(2, (64, 30))
PROMPTS = [
    ("a picture: <image> what is it?", CAT),
    ("say what <image> shows", DOG),
    ("a picture: <image> what is it?", DOG),
    ("The quick brown fox", None),
    ("Paged attention stores keys", None),
]
_HF: dict = {}


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory):
    return build_tiny_vlm(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def expected(folder):
    return [hf_tokens(folder, text, image) for text, image in PROMPTS]


def hf_inputs(folder, text: str, image):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if folder not in _HF:
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        _HF[folder] = (AutoProcessor.from_pretrained(folder), model.eval())
    processor, model = _HF[folder]
    images = None if image is None else [image]
    return model, processor(text=text, images=images, return_tensors="pt")


def hf_tokens(folder, text: str, image) -> list[int]:
    import torch

    model, inputs = hf_inputs(folder, text, image)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0][inputs["input_ids"].shape[1] :].tolist()


def items(prompts=PROMPTS) -> list:
    return [
        text if image is None else {"prompt": text, "multi_modal_data": {"image": image}}
        for text, image in prompts
    ]


def tokens(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_batched_with_text_prompts_and_prefix_hits(folder, expected):
    llm = LLM(str(folder), kv_cache_memory="8MiB", dtype="float32", block_size=4)
    assert tokens(llm.generate(items(), GREEDY, use_tqdm=False)) == expected
    again = llm.generate(items(PROMPTS[:1]), GREEDY, use_tqdm=False)[0]
    assert list(again.outputs[0].token_ids) == expected[0]
    prompt_len = len(again.prompt_token_ids)
    assert again.num_cached_tokens == (prompt_len - 1) // 4 * 4  # all its full blocks
    # the same text before a different image: only the blocks before the image are shared
    other = llm.generate(items([(PROMPTS[0][0], random_image(3))]), GREEDY, use_tqdm=False)[0]
    first_image_position = other.prompt_token_ids.index(_image_token_id(llm))
    assert other.num_cached_tokens == first_image_position // 4 * 4
    assert len(llm.engine.worker.runner.encoder_cache) == 0


def test_chunked_prefill_through_an_image(folder, expected):
    # 8 tokens a step: each image's span is cut in chunks, and its embeddings exceed the
    # step's encoder budget (it runs alone, once, then its rows are spliced chunk by chunk)
    llm = LLM(
        str(folder), kv_cache_memory="8MiB", dtype="float32", block_size=4,
        max_num_batched_tokens=8, max_model_len=256,
    )  # fmt: skip
    assert tokens(llm.generate(items(), GREEDY, use_tqdm=False)) == expected
    cache = llm.engine.worker.runner.encoder_cache
    assert len(cache) == 0 and cache.num_encoded >= 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_image_requests_equal_hf(folder, expected, mode):
    # room for the longest sequence and a few blocks more, not for all of them at once
    longest = max(hf_inputs(folder, *p)[1]["input_ids"].shape[1] for p in PROMPTS)
    blocks = -(-(longest + MAX_TOKENS) // 4) + 3
    llm = LLM(
        str(folder), dtype="float32", block_size=4, kv_cache_memory=_bytes(blocks),
        swap_space=0.01, preemption_mode=mode, max_num_batched_tokens=16,
        max_model_len=longest + MAX_TOKENS,
    )  # fmt: skip
    assert tokens(llm.generate(items(), GREEDY, use_tqdm=False)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert len(llm.engine.worker.runner.encoder_cache) == 0


def _image_token_id(llm) -> int:
    return llm.engine.worker.runner.input_batch.image_token_id


def _bytes(count: int) -> int:
    """Bytes of `count` KV blocks of 4 tokens (the tiny text model: 2 layers, 2 KV heads of
    16 dims, float32)."""
    return count * 4 * 2 * 2 * 2 * 16 * 4
