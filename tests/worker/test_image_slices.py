"""The worker's image rows: which flat rows of a chunk take which encoder output rows
(chunks cutting through a span, tile markers inside it), and the encoder cache's lifetime."""

import numpy as np
import pytest
import torch

from services.common.image_input import ImageInput
from services.worker.multimodal.encoder_cache import EncoderCache
from services.worker.multimodal.image_slice import image_slices

IMG = 9


def test_a_chunk_through_a_span_with_markers_takes_the_right_rows():
    # span 4..13: image tokens with two marker tokens (5 and 6) between the tiles
    tokens = np.array([1, 2, 3, 4, IMG, IMG, IMG, 5, 6, IMG, IMG, IMG, IMG, IMG, 7, 8])
    image = ImageInput(4, 10, 8, "h")
    first = image_slices("r", (image,), tokens, 0, 8, 0, IMG)  # positions 0..7
    assert first[0].rows.tolist() == [4, 5, 6] and first[0].embed_index.tolist() == [0, 1, 2]
    assert not first[0].done
    # the rest of the prompt in a second chunk, the request's rows starting at flat row 3
    rest = image_slices("r", (image,), tokens, 8, 8, 3, IMG)
    assert rest[0].rows.tolist() == [4, 5, 6, 7, 8]  # positions 9..13
    assert rest[0].embed_index.tolist() == [3, 4, 5, 6, 7]
    assert rest[0].done
    assert image_slices("r", (image,), tokens, 14, 2, 0, IMG) == []


def test_a_span_with_the_wrong_count_of_image_tokens_is_refused():
    tokens = np.array([IMG, IMG, 3, 4])
    with pytest.raises(ValueError, match="holds 2 image tokens, not its 3"):
        image_slices("r", (ImageInput(0, 4, 3, "h"),), tokens, 0, 4, 0, IMG)


def test_the_encoder_cache_shares_equal_images_and_frees_them():
    calls = []

    def encode(image):
        calls.append(image.content_hash)
        return torch.full((image.num_embeds, 2), float(len(calls)))

    cache = EncoderCache()
    cat = ImageInput(0, 3, 3, "cat")
    first = cache.get("a", cat, encode)
    assert torch.equal(cache.get("b", cat, encode), first) and calls == ["cat"]
    cache.release("a", "cat")
    assert len(cache) == 1  # b still prefills its span
    cache.drop("b")
    assert len(cache) == 0
    cache.get("c", cat, encode)
    assert calls == ["cat", "cat"]
