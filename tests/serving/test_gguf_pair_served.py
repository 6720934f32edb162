"""llama.cpp's file pair served (`--mmproj`, as llama-server takes it): the official openai
client's image chat (a data URL) against a tiny Idefics3's text GGUF + mmproj GGUF gets HF
generate's greedy reply on the HF folder the pair was written from (float32)."""

from __future__ import annotations

import base64
import io

import pytest
import pytest_asyncio

from tests.helpers.mmproj_writer import write_pair
from tests.helpers.model_cache import isolated_model_cache
from tests.helpers.openai_server import MODEL, running_server
from tests.helpers.tiny_vlms import build_tiny_vlm, random_image

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 6
IMAGE = random_image(9, (64, 48))
PARTS = [{"type": "text", "text": "what is it? "}, {"type": "image"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_vlm("idefics3", tmp_path_factory.mktemp("idefics3"), seed=2)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(folder, tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        isolated_model_cache(tmp_path_factory.mktemp("cache"), monkeypatch)
        text, mmproj, _ = write_pair(folder, tmp_path_factory.mktemp("pair"))
        async with running_server(text, mmproj=str(mmproj), dtype="float32") as s:
            yield s


def hf_reply(folder) -> str:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": PARTS}], tokenize=False, add_generation_prompt=True
    )
    inputs = processor(text=text, images=[IMAGE], return_tensors="pt", add_special_tokens=False)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0][inputs["input_ids"].shape[1] :]
    return processor.tokenizer.decode(new, skip_special_tokens=True)


async def test_an_image_chat_with_the_pair_equals_hf_generate(server, folder):
    png = io.BytesIO()
    IMAGE.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [PARTS[0], {"type": "image_url", "image_url": {"url": url}}]
    reply = await server.async_client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "length"
    # a reply's text holds back a last token that ends inside a UTF-8 character, which
    # HF's decode of the whole reply spells as U+FFFD
    assert reply.choices[0].message.content == hf_reply(folder).removesuffix("\ufffd")
