"""LLM(model=text.gguf, mmproj=mmproj.gguf), llama.cpp's file pair written from each tiny VLM
family's HF folder (tests/helpers/mmproj_writer.py): greedy tokens for an image prompt equal
HF generate's on the original folder (float32), and the encoder's weights are the folder's.
A quantized text GGUF stays quantized (the native kernels run its blocks): its tokens equal
HF's on the same weights de-quantized (dequantized_folder)."""

from __future__ import annotations

import pytest
import torch

from pagestream import LLM
from services.common.model_source import resolve_pair
from services.common.sampling_params import SamplingParams
from services.worker.layers.quantization.model_weights import weight_formats
from services.worker.models.gguf_weights import dequantized_folder
from tests.helpers.mmproj_writer import write_pair
from tests.helpers.model_cache import isolated_model_cache
from tests.helpers.tiny_vlms import FAMILIES, build_tiny_vlm, random_image

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
PROMPT = "describe <image> now"
IMAGE = random_image(11, (70, 52))


def prompt_of(family: str) -> str:
    """PROMPT with the family's image marker (Gemma 3's processor expands <start_of_image>)."""
    return PROMPT.replace("<image>", "<start_of_image>") if family == "gemma3" else PROMPT


def hf_tokens(folder, images: list, prompt: str = PROMPT) -> list[int]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    # Gemma 3's token_type_ids come along: its image tokens attend both ways
    inputs = processor(text=prompt, images=images, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0][inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_pair_generates_what_hf_generates_on_the_folder(family, tmp_path, monkeypatch):
    isolated_model_cache(tmp_path / "cache", monkeypatch)
    folder = build_tiny_vlm(family, tmp_path / family, seed=5)
    text, mmproj, _ = write_pair(folder, tmp_path)
    llm = LLM(str(text), mmproj=str(mmproj), kv_cache_memory="8MiB", dtype="float32")
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": IMAGE}}
    (output,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert list(output.outputs[0].token_ids) == hf_tokens(folder, [IMAGE])
    (plain,) = llm.generate("describe now", GREEDY, use_tqdm=False)  # text alone still runs
    assert len(plain.outputs[0].token_ids) == MAX_TOKENS


# the text model's linears, by kind (the vision modules' are other kinds): each must hold
# the GGUF's blocks, not a float32 copy
TEXT_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


@pytest.mark.parametrize("text_type", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("family", [*FAMILIES, "gemma3"])
def test_a_quantized_text_gguf_runs_quantized(family, text_type, tmp_path, monkeypatch):
    isolated_model_cache(tmp_path / "cache", monkeypatch)
    folder = build_tiny_vlm(family, tmp_path / family, seed=5)
    text, mmproj, _ = write_pair(folder, tmp_path, text_type=text_type)
    llm = LLM(str(text), mmproj=str(mmproj), kv_cache_memory="8MiB", quantization="gguf")
    model = llm.engine.worker.model
    assert llm.engine.model_info.quantization == text_type
    formats = weight_formats(model)
    assert {kind: formats[kind] for kind in TEXT_LINEARS} == dict.fromkeys(TEXT_LINEARS, text_type)
    prompt = {"prompt": prompt_of(family), "multi_modal_data": {"image": IMAGE}}
    (output,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    reference = dequantized_folder(resolve_pair(text, mmproj))  # the same weights, float32
    assert list(output.outputs[0].token_ids) == reference_tokens(reference, family, output)


def test_gemma3_pair_generates_what_hf_generates(tmp_path, monkeypatch):
    """Gemma 3's pair (gemma3 text GGUF + gemma3 projector), float32: greedy tokens equal
    HF Gemma3ForConditionalGeneration's (token_type_ids: the image attends both ways) on
    the pair's weights; those weights are the original folder's (test_gguf_mmproj)."""
    isolated_model_cache(tmp_path / "cache", monkeypatch)
    folder = build_tiny_vlm("gemma3", tmp_path / "gemma3", seed=5)
    text, mmproj, _ = write_pair(folder, tmp_path)
    llm = LLM(str(text), mmproj=str(mmproj), kv_cache_memory="8MiB", dtype="float32")
    prompt = {"prompt": prompt_of("gemma3"), "multi_modal_data": {"image": IMAGE}}
    (output,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    reference = dequantized_folder(resolve_pair(text, mmproj))
    assert list(output.outputs[0].token_ids) == reference_tokens(reference, "gemma3", output)


def reference_tokens(folder, family: str, output) -> list[int]:
    """HF generate's tokens for the engine's image prompt. Gemma 3 gets the prompt ids the
    engine ran: its tiny byte-level vocabulary, read by transformers' Gemma tokenizer, has
    no newline, and the processor's "\\n\\n" around the image fuses into one unknown
    token where the frontend's tokenization around the image gives two (a real Gemma
    vocabulary holds "\\n\\n" whole); its soft tokens are marked in token_type_ids."""
    if family != "gemma3":
        return hf_tokens(folder, [IMAGE], prompt_of(family))
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([output.prompt_token_ids])
    soft = ids == model.config.image_token_index
    assert soft.sum() == 4  # the image's soft tokens, found whole
    pixels = processor(text=prompt_of(family), images=[IMAGE], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            token_type_ids=soft.long(),
            pixel_values=pixels["pixel_values"],
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return out[0][ids.shape[1] :].tolist()
