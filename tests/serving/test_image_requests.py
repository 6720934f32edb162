"""Images through the served APIs (the official openai and anthropic clients): a tiny LLaVA's
greedy reply to an image chat equals HF generate's with the same image (float32), by the
chat, Responses and Messages APIs and the public gRPC API alike; each bad image input is a
400 (gRPC: INVALID_ARGUMENT) naming it, and a text-only model refuses images by name."""

from __future__ import annotations

import base64
import io

import anthropic
import grpc
import openai
import pytest
import pytest_asyncio

from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from services.frontend.frontend_config import FrontendConfig
from services.frontend.frontend_server import serve_frontend
from tests.helpers.grpc_calls import collect, per_index
from tests.helpers.openai_server import API_KEY, MODEL, TIMEOUT, running_server
from tests.helpers.tiny_vlms import build_tiny_vlm, random_image

pytestmark = pytest.mark.asyncio(loop_scope="module")

QUESTION = "what is it? "
MAX_TOKENS = 6
LIMIT = 2
MAX_PIXELS = 100 * 100


def encoded(image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


IMAGE = random_image(7, (60, 45))
URL = data_url(encoded(IMAGE))


def image_part(url: str = URL) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *parts]}]


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory):
    return build_tiny_vlm("llava", tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(encoded(IMAGE))
    return root


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(vlm_folder, media_root):
    config = FrontendConfig(
        limit_mm_per_prompt=f'{{"image": {LIMIT}}}',
        max_image_pixels=MAX_PIXELS,
        allowed_local_media_path=str(media_root),
    )
    async with running_server(vlm_folder, frontend_config=config, dtype="float32") as s:
        yield s


def hf_inputs(vlm_folder):
    """The HF processor's inputs for the chat (the same template and image), and it."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm_folder)
    parts = [{"type": "text", "text": QUESTION}, {"type": "image"}]
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    inputs = processor(text=text, images=[IMAGE], return_tensors="pt", add_special_tokens=False)
    return inputs, processor


@pytest.fixture(scope="module")
def hf_reply(vlm_folder) -> str:
    """HF generate's greedy reply to the chat."""
    import torch
    from transformers import AutoModelForImageTextToText

    inputs, processor = hf_inputs(vlm_folder)
    model = AutoModelForImageTextToText.from_pretrained(vlm_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0][inputs["input_ids"].shape[1] :]
    return processor.tokenizer.decode(new, skip_special_tokens=True)


async def _chat_text(server, messages) -> str:
    reply = await server.async_client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"
    return reply.choices[0].message.content


async def test_an_image_chat_equals_hf_generate(server, hf_reply):
    assert await _chat_text(server, chat(image_part())) == hf_reply
    bare = {"type": "image_url", "image_url": URL}  # the bare-string form
    assert await _chat_text(server, chat(bare)) == hf_reply
    assert await _chat_text(server, chat(image_part(f"file://{server_media(server)}"))) == hf_reply


def server_media(server) -> str:
    return f"{server.engine.frontend.config.allowed_local_media_path}/cat.png"


async def test_the_responses_and_messages_apis_take_the_same_image(server, hf_reply):
    content = [
        {"type": "input_text", "text": QUESTION},
        {"type": "input_image", "image_url": URL},
    ]
    response = await server.async_client().responses.create(
        model=MODEL,
        input=[{"role": "user", "content": content}],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.output_text == hf_reply
    client = anthropic.AsyncAnthropic(
        base_url=server.http.url, api_key=API_KEY, max_retries=0, timeout=TIMEOUT
    )
    source = {"type": "base64", "media_type": "image/png", "data": URL.split(",", 1)[1]}
    blocks = [{"type": "text", "text": QUESTION}, {"type": "image", "source": source}]
    message = await client.messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": blocks}],
        extra_body={"temperature": 0},
    )
    await client.close()
    assert message.content[0].text == hf_reply


async def test_token_counts_count_each_images_tokens(server, vlm_folder):
    expected = hf_inputs(vlm_folder)[0]["input_ids"][0].tolist()
    async with server.raw() as client:
        body = {"model": MODEL, "messages": chat(image_part())}
        response = await client.post("/tokenize", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["tokens"] == expected
        source = {"type": "base64", "media_type": "image/png", "data": URL.split(",", 1)[1]}
        blocks = [{"type": "text", "text": QUESTION}, {"type": "image", "source": source}]
        body = {"model": MODEL, "messages": [{"role": "user", "content": blocks}]}
        response = await client.post("/v1/messages/count_tokens", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["input_tokens"] == len(expected)


BIG = data_url(encoded(random_image(1, (120, 120))))
TIFF = data_url(encoded(random_image(1, (20, 20)), "TIFF"), "image/tiff")


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        (chat(image_part("data:image/png;base64,@@@")), "base64 is not valid"),
        (chat(image_part(TIFF)), "supported format"),
        (chat(image_part(BIG)), "--max-image-pixels"),
        (chat(*[image_part()] * (LIMIT + 1)), f"more than the limit of {LIMIT}"),
        (chat(image_part("https://example.com/cat.png")), "--allowed-media-domains"),
        (chat(image_part("file:///etc/passwd")), "not a file under the allowed media folder"),
        (chat(image_part("data:image/png;base64,")), "supported format"),
        (chat(image_part({"nope": 1})), "messages"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "<image>"}, image_part()]}],
            "2 image marker(s)",
        ),
    ],
)
async def test_bad_images_are_400s_naming_them(server, messages, words):
    with pytest.raises(openai.BadRequestError) as info:
        await _chat_text(server, messages)
    assert words in info.value.message
    assert await _chat_text(server, chat(image_part())) is not None  # still serving


async def test_a_text_model_refuses_images_by_name(model_dir):
    async with running_server(model_dir("llama")) as text_server:
        with pytest.raises(openai.BadRequestError) as info:
            await _chat_text(text_server, chat(image_part()))
    assert "messages[0].content[1]: this model does not take images" in info.value.message


# ---- the public gRPC API --------------------------------------------------------------------
def grpc_chat(*parts) -> pb.GenerateRequest:
    message = pb.ChatMessage(role="user", parts=[pb.ContentPart(text=QUESTION), *parts])
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return pb.GenerateRequest(chat=pb.ChatMessages(messages=[message]), sampling_params=sampling)


async def test_grpc_chat_parts_take_image_bytes_and_urls(server, hf_reply):
    handle = await serve_frontend(server.engine.frontend, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for part in (pb.ContentPart(image=encoded(IMAGE)), pb.ContentPart(image_url=URL)):
                replies = per_index(await collect(stub, grpc_chat(part)))
                assert replies[0]["text"] == hf_reply
            for bad, words in [
                (pb.ContentPart(image=b"garbage"), "supported format"),
                (pb.ContentPart(image_url="https://example.com/x.png"), "allowed-media-domains"),
                (pb.ContentPart(), "set text, image or image_url"),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await collect(stub, grpc_chat(bad))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert words in info.value.details()
    finally:
        await handle.stop(grace=None)
