"""benchmarks/vlm.py without a server: the shapes are SmolVLM-256M's, HF's processor gives a
512x512 image as many image tokens as llama.cpp's mtmd does, the requests carry the image
as a data URL, no image is sent twice, the servers take turns and the ratios point the
right way."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from benchmarks.vlm import (
    CHAT_TEMPLATE,
    IMAGE_SIZE,
    SCALE_FACTOR,
    TEXT,
    TILE_TOKENS,
    VISION,
    ImageSeeds,
    MtmdServer,
    VlmOptions,
    _turns,
    agreement,
    chat_body,
    image_png,
    mtmd_image_tokens,
    processor,
    ratios,
    summarize,
    with_image_tokens,
)
from tests.helpers.tiny_tokenizer import build_tokenizer


def _parameters(hidden: int, inter: int, layers: int) -> int:
    """A pre-norm transformer's block parameters (no biases, no norms)."""
    return layers * (4 * hidden * hidden + 2 * hidden * inter)


def test_the_shapes_are_smolvlm_256m():
    assert TILE_TOKENS == 64  # (512 / 16)^2 patches, shuffled by 4 x 4
    vision = _parameters(VISION["hidden_size"], VISION["intermediate_size"], 12)
    assert vision == pytest.approx(85e6, rel=0.01)  # SigLIP-base's blocks
    text_heads = TEXT["hidden_size"] // TEXT["num_attention_heads"]
    assert text_heads == 64 and TEXT["num_attention_heads"] % TEXT["num_key_value_heads"] == 0
    connector = VISION["hidden_size"] * SCALE_FACTOR**2 * TEXT["hidden_size"]
    assert connector == 12288 * 576


def test_hf_and_mtmd_give_a_512_image_the_same_image_tokens():
    """2 x 2 tiles and the global image on both sides: 320 image tokens."""
    proc = processor(with_image_tokens(build_tokenizer()))
    image = Image.open(io.BytesIO(image_png(3)))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    ids = proc(text=text, images=[image], return_tensors="np")["input_ids"][0].tolist()
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == mtmd_image_tokens(*IMAGE_SIZE) == 5 * TILE_TOKENS


def test_mtmd_always_adds_the_overview():
    assert mtmd_image_tokens(512, 512) == 5 * 64  # resized to 1024: 2 x 2 tiles
    assert mtmd_image_tokens(1024, 256) == 3 * 64  # 2 x 1 tiles
    assert mtmd_image_tokens(100, 100) == 5 * 64  # small images are scaled up too


def test_the_chat_template_renders_content_lists_and_strings_alike():
    tokenizer = with_image_tokens(build_tokenizer())
    parts = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "q"}]
    as_list = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    as_string = tokenizer.apply_chat_template(
        [{"role": "user", "content": "<image>q"}], tokenize=False, add_generation_prompt=True
    )
    assert as_list == as_string == "<|im_start|>User:<image>q<end_of_utterance>\nAssistant:"
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_a_chat_carries_its_image_as_a_png_data_url():
    body = chat_body(image_png(7), max_tokens=64)
    url = body["messages"][0]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert image.size == IMAGE_SIZE
    assert body["max_tokens"] == 64 and body["temperature"] == 0
    assert body["extra_body"] == {"ignore_eos": True}
    assert image_png(7) != image_png(8)


def test_no_image_seed_is_taken_twice():
    seeds = ImageSeeds(10)
    taken = seeds.take(1) + seeds.take(8) + seeds.take(1)
    assert taken == list(range(10, 20))


def test_the_servers_take_turns_going_first():
    servers = {"pagestream": "a", "llama-server": "b"}
    assert _turns(servers, 0) == ["pagestream", "llama-server"]
    assert _turns(servers, 1) == ["llama-server", "pagestream"]


def _medians(**medians) -> dict:
    return {name: {"median": value} for name, value in medians.items()}


def test_ratios_above_one_mean_pagestream_is_ahead():
    rounds = [{"seconds": 2.0}, {"seconds": 4.0}, {"seconds": 3.0}]
    assert summarize(rounds, "seconds") == {
        "median": 3.0,
        "per_round": [2.0, 4.0, 3.0],
        "rounds": rounds,
    }
    part = {
        "ttft_offline_s": _medians(**{"pagestream": 3.0, "llama.cpp": 4.5}),
        "ttft_served_s": _medians(**{"pagestream": 3.0, "llama-server": 6.0}),
        "output_tokens_per_s": _medians(**{"pagestream": 30.0, "llama-server": 20.0}),
    }
    assert ratios(part) == {
        "ttft_offline_theirs_over_ours": 1.5,
        "ttft_served_theirs_over_ours": 2.0,
        "throughput_ours_over_llama_server": 1.5,
    }
    assert ratios({"ttft_offline_s": part["ttft_offline_s"]}) == {
        "ttft_offline_theirs_over_ours": 1.5
    }


def _reply(text: str, **top) -> dict:
    return {"text": text, "first_top_logprobs": top}


def test_agreement_counts_the_common_start_and_the_logprob_gap():
    same = agreement(
        {
            "pagestream": _reply("a cat", a=-0.1, b=-2.5),
            "llama-server": _reply("a cat", a=-0.1, b=-2.4, c=-3.0),
        }
    )
    assert same["equal"] and same["common_prefix_chars"] == 5
    assert same["shared_top_tokens"] == 2 and same["max_logprob_gap"] == pytest.approx(0.1)
    apart = agreement({"pagestream": _reply("a cat sat"), "llama-server": _reply("a dog")})
    assert not apart["equal"] and apart["common_prefix_chars"] == 2
    assert apart["shared_top_tokens"] == 0 and apart["max_logprob_gap"] is None
    prefix = agreement({"pagestream": _reply("a cat"), "llama-server": _reply("a ca")})
    assert not prefix["equal"] and prefix["common_prefix_chars"] == 4


def test_llama_server_gets_the_mmproj_slots_and_threads():
    server = MtmdServer("llama-server", Path("t.gguf"), Path("m.gguf"), slots=8, threads=2)
    command = server.command()
    for flag, value in (("--mmproj", "m.gguf"), ("-np", "8"), ("-t", "2"), ("-tb", "2")):
        assert command[command.index(flag) + 1] == value
    assert command[command.index("-c") + 1] == str(8 * server.context_per_slot)


def test_half_precision_is_bfloat16_against_an_f16_pair():
    assert (VlmOptions().dtype, VlmOptions().gguf_type) == ("float32", "F32")
    half = VlmOptions(precision="half")
    assert (half.dtype, half.gguf_type) == ("bfloat16", "F16")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"rounds": 0}, "must be >= 1"),
        ({"concurrency": 0}, "must be >= 1"),
        ({"threads": 0}, "must be >= 1"),
        ({"output_len": 0}, "must be >= 1"),
        ({"parts": ("ttft",)}, "parts must be among"),
        ({"parts": ()}, "parts must be among"),
        ({"precision": "int8"}, "precision must be one of"),
    ],
)
def test_options_refuse_empty_or_unknown_runs(bad, message):
    with pytest.raises(ValueError, match=message):
        VlmOptions("llama-server", **bad)
