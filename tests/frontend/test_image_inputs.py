"""The frontend's images: media loading and decoding under the operator's bounds, and the
ImageInputs built from each tiny VLM family's HF processor (ids, spans, data, hashes
against the processor's own whole-prompt output)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest

from services.common.image_input import check_images
from services.frontend.frontend_config import DEFAULT_IMAGE_LIMIT, FrontendConfig
from services.frontend.multimodal.chat_images import split_images
from services.frontend.multimodal.image_decoder import decode_image
from services.frontend.multimodal.image_loader import ImageLoader
from services.frontend.multimodal.image_processor import TEXT_KEYS, ImageProcessor
from services.frontend.multimodal.media_loader import MediaLoader
from services.frontend.tokenizer import apply_chat_template
from tests.helpers.tiny_vlms import (
    FAMILIES,
    build_gemma3_processor_folder,
    build_tiny_vlm,
    random_image,
)

TEXT = "look:\n<image> and then<image>!"


def encoded(image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height (its pixel data is a few bytes: a bomb's shape)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 16)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.fixture(scope="module", params=(*FAMILIES, "gemma3"))
def vlm(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        build_gemma3_processor_folder(folder)
    else:
        build_tiny_vlm(request.param, folder)
    processor = ImageProcessor.from_folder(folder)
    assert processor is not None
    return processor


# ---- the processor ----------------------------------------------------------------------
def test_ids_spans_and_data_equal_the_processors_whole_prompt_output(vlm):
    images = [random_image(0, (50, 40)), random_image(1, (70, 30))]
    text = TEXT.replace("<image>", vlm.marker)
    ids, inputs = vlm.process(text, images, add_special_tokens=False)
    whole = vlm.processor(text=text, images=images, return_tensors="np", add_special_tokens=False)
    assert ids == whole["input_ids"][0].tolist()
    check_images(inputs, len(ids))
    # the spans partition the image-token positions, each starting and ending on one
    positions = [i for i, t in enumerate(ids) if t == vlm.image_token_id]
    assert [p for i in inputs for p in range(i.offset, i.end) if ids[p] == vlm.image_token_id] == (
        positions
    )
    for image in inputs:
        assert ids[image.offset] == ids[image.end - 1] == vlm.image_token_id
        assert ids[image.offset : image.end].count(vlm.image_token_id) == image.num_embeds
    # each image's tensors are its own slice of the whole call's (one-image batch dims)
    tile_axis = 0 if inputs[0].data["pixel_values"].ndim == 4 else 1
    for name, whole_array in whole.items():
        if name in TEXT_KEYS:
            continue
        parts = [i.data[name] for i in inputs]
        assert all(p.shape[0] == 1 for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts, axis=tile_axis), whole_array)


def test_hashes_name_the_pixels(vlm):
    _, (a, b) = vlm.process(vlm.marker * 2, [random_image(3), random_image(3)])
    _, (c,) = vlm.process(vlm.marker, [random_image(4)])
    assert a.content_hash == b.content_hash != c.content_hash


def test_markers_must_match_the_images(vlm):
    with pytest.raises(ValueError, match=r"1 image marker\(s\).*for 2 image"):
        vlm.process(f"one {vlm.marker} only", [random_image(0), random_image(1)])
    with pytest.raises(ValueError, match="0 image marker"):
        vlm.process("no marker", [random_image(0)])


def test_a_text_model_has_no_image_processor(model_dir):
    assert ImageProcessor.from_folder(model_dir("llama")) is None


def test_chat_parts_render_as_the_models_marker(vlm):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is "},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "image_url", "image_url": "data:image/png;base64,BBBB"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]},
    ]
    template_messages, images = split_images(messages)
    assert images == ["data:image/png;base64,AAAA", "data:image/png;base64,BBBB"]
    text = apply_chat_template(vlm.tokenizer, template_messages)
    assert text.count(vlm.marker) == 2 and "what is " + vlm.marker in text
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].*url"):
        split_images([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_a_text_template_refuses_image_parts_by_name(byte_tokenizer):
    byte_tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    part = {"type": "image_url", "image_url": {"url": "x"}}
    with pytest.raises(ValueError, match="'image_url' are not supported"):
        apply_chat_template(byte_tokenizer, [{"role": "user", "content": [part]}])


# ---- decoding -----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_allowed_formats_decode_to_rgb(fmt):
    image = decode_image(encoded(random_image(0, (20, 10)), fmt), max_pixels=1000)
    assert image.mode == "RGB" and image.size == (20, 10)


def test_other_formats_and_garbage_are_refused():
    with pytest.raises(ValueError, match="supported format"):
        decode_image(encoded(random_image(0), "TIFF"), 0)
    with pytest.raises(ValueError, match="supported format"):
        decode_image(b"not an image at all", 0)


def test_pixels_are_checked_before_decoding():
    with pytest.raises(ValueError, match=r"200x100 is 20000 pixels.*--max-image-pixels"):
        decode_image(png_header(200, 100), max_pixels=10_000)
    with pytest.raises(ValueError, match="decompression bomb"):
        decode_image(png_header(100_000, 100_000), max_pixels=0)  # PIL's own bound


def test_truncated_data_is_refused():
    data = encoded(random_image(0, (64, 64)), "PNG")
    with pytest.raises(ValueError, match="could not be decoded"):
        decode_image(data[: len(data) // 2], 0)


# ---- loading ------------------------------------------------------------------------------
def test_data_urls():
    loader = MediaLoader(max_bytes=1000)
    assert loader.load(data_url(b"\x89PNG")) == b"\x89PNG"
    with pytest.raises(ValueError, match="base64 is not valid"):
        loader.load("data:image/png;base64,@@not base64@@")
    with pytest.raises(ValueError, match="'text/plain' is not image"):
        loader.load("data:text/plain;base64,AAAA")
    with pytest.raises(ValueError, match="data:image/<format>;base64"):
        loader.load("data:image/png,rawbytes")
    with pytest.raises(ValueError, match=r"over 1000 bytes.*--max-image-bytes"):
        loader.load(data_url(b"x" * 2000))


def test_urls_are_refused_unless_allowed():
    loader = MediaLoader(max_bytes=0)
    with pytest.raises(ValueError, match=r"fetches no images from 'example\.com'"):
        loader.load("https://example.com/cat.png")
    with pytest.raises(ValueError, match="reads no local files"):
        loader.load("file:///etc/passwd")
    with pytest.raises(ValueError, match="reads no local files"):
        loader.load("/etc/passwd")
    with pytest.raises(ValueError, match="scheme 'ftp' is not supported"):
        loader.load("ftp://example.com/cat.png")
    allowed = MediaLoader(max_bytes=0, domains=frozenset({"images.example"}))
    with pytest.raises(ValueError, match=r"from 'evil\.example'"):
        allowed.load("http://evil.example/x.png")


def test_local_files_only_inside_the_allowed_folder(tmp_path):
    root, outside = tmp_path / "media", tmp_path / "secret.png"
    root.mkdir()
    (root / "cat.png").write_bytes(b"cat")
    outside.write_bytes(b"secret")
    (root / "link.png").symlink_to(outside)
    loader = MediaLoader(max_bytes=5, local_root=root.resolve())
    assert loader.load(f"file://{root}/cat.png") == b"cat"
    assert loader.load(str(root / "cat.png")) == b"cat"
    for escape in (str(root / "link.png"), f"{root}/../secret.png", str(outside)):
        with pytest.raises(ValueError, match="not a file under the allowed media folder"):
            loader.load(escape)
    with pytest.raises(ValueError, match="no such file"):
        loader.load(f"{root}/missing.png")
    (root / "big.png").write_bytes(b"x" * 6)
    with pytest.raises(ValueError, match="over 5 bytes"):
        loader.load(str(root / "big.png"))


def test_the_image_limit_and_its_flag():
    assert FrontendConfig().image_limit == DEFAULT_IMAGE_LIMIT
    assert FrontendConfig(limit_mm_per_prompt='{"image": 1}').image_limit == 1
    assert FrontendConfig(limit_mm_per_prompt={"image": 0}).image_limit == 0  # LLM's keyword
    for bad, match in [
        ("{oops", "not JSON"),
        ("[1]", "JSON object"),
        ('{"video": 1}', "'video' is not a modality"),
        ('{"image": -1}', "integer >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            FrontendConfig(limit_mm_per_prompt=bad)
    loader = ImageLoader(FrontendConfig(limit_mm_per_prompt='{"image": 1}', max_image_pixels=100))
    with pytest.raises(ValueError, match=r"2 images, more than the limit of 1 .*limit_mm_per"):
        loader.load_all([random_image(0), random_image(1)])
    with pytest.raises(ValueError, match="over the limit of 100 pixels"):
        loader.load_all([random_image(0, (20, 20))])
    png = data_url(encoded(random_image(0, (10, 10))))
    assert loader.load_all([png])[0].size == (10, 10)


# ---- the engine request -------------------------------------------------------------------
def test_the_engine_request_carries_the_images_and_counts_their_tokens(vlm):
    from services.common.sampling_params import SamplingParams
    from services.common.served_model_info import ServedModelInfo
    from services.frontend.input_processor import ContextLengthExceededError, InputProcessor

    vocab = len(vlm.tokenizer) + 16
    text = "see " + vlm.marker
    prompt = {"prompt": text, "multi_modal_data": {"image": random_image(2)}}
    ids, inputs = vlm.process(text, [random_image(2)])
    fits = InputProcessor(vlm.tokenizer, ServedModelInfo("m", len(ids), vocab, (0,)), vlm)
    request, _ = fits.make_request(None, prompt, SamplingParams(max_tokens=1))
    assert request.prompt_token_ids == ids and request.images == inputs
    short = InputProcessor(vlm.tokenizer, ServedModelInfo("m", len(ids) - 1, vocab, (0,)), vlm)
    with pytest.raises(ContextLengthExceededError, match=f"has {len(ids)} tokens"):
        short.make_request(None, prompt, SamplingParams(max_tokens=1))
    text_only = InputProcessor(vlm.tokenizer, ServedModelInfo("m", 999, vocab, (0,)))
    with pytest.raises(ValueError, match="this model does not take images"):
        text_only.make_request(None, prompt, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="multi_modal_data must be"):
        fits.process({"prompt": "x", "multi_modal_data": {"video": []}})


def test_gemma3s_spans_are_its_soft_tokens_and_its_text_is_tokenized_whole(tmp_path):
    vlm = ImageProcessor.from_folder(build_gemma3_processor_folder(tmp_path))
    assert vlm.marker == "<start_of_image>"
    assert vlm.image_token_id == vlm.tokenizer.convert_tokens_to_ids("<soft>")
    ids, (image,) = vlm.process("a\n<start_of_image>b", [random_image(0)])
    assert image.num_embeds == image.length == 4  # the soft tokens, not <start_of_image>
    assert ids[image.offset - 1] == vlm.marker_id
    assert not vlm._between_added_tokens(vlm._one(random_image(0))[0])  # "\n\n" at its edges


SMOLVLM_LIKE = (  # loops over content parts only, as SmolVLM's template does
    "{% for m in messages %}{{ m['role'] }}:{% for line in m['content'] %}"
    "{% if line['type'] == 'text' %}{{ line['text'] }}{% else %}<image>{% endif %}"
    "{% endfor %}\n{% endfor %}"
)


def test_a_template_that_reads_parts_gets_parts_for_text_too(byte_tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "image"}]},
        {"role": "assistant", "content": None},
    ]
    text = apply_chat_template(byte_tokenizer, messages, False, SMOLVLM_LIKE)
    assert text.startswith("system:be brief") and "user:hi <image>" in text  # nothing lost
    assert text.rstrip().endswith("assistant:")


@pytest.fixture
def http_server():
    """A loopback HTTP server: /cat.png (an image), /big (over the cap), /away (a redirect
    to a host that is not allowed), anything else 404."""
    import http.server
    import threading

    png = encoded(random_image(0, (10, 10)))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/away":
                self.send_response(302)
                self.send_header("Location", "http://elsewhere.example/cat.png")
                self.end_headers()
                return
            body = {"/cat.png": png, "/big": b"x" * 5000}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_allowed_hosts_are_fetched_within_the_cap(http_server):
    loader = MediaLoader(max_bytes=1000, domains=frozenset({"127.0.0.1"}), timeout_s=5)
    assert decode_image(loader.load(f"{http_server}/cat.png"), 0).size == (10, 10)
    with pytest.raises(ValueError, match="over 1000 bytes"):
        loader.load(f"{http_server}/big")
    with pytest.raises(ValueError, match="HTTP 404"):
        loader.load(f"{http_server}/missing")
    with pytest.raises(ValueError, match=r"fetches no images from 'elsewhere\.example'"):
        loader.load(f"{http_server}/away")
