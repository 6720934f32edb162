"""ImageInput over the wire: a round trip keeps spans, hashes and arrays; what a sender
controls (dtype, rank, shape against bytes, spans) is checked before use."""

import numpy as np
import pytest

from services.common.convert.engine_io import engine_request_from_pb, engine_request_to_pb
from services.common.convert.image import array_from_pb, array_to_pb, images_from_pb
from services.common.engine_request import EngineCoreRequest
from services.common.image_input import ImageInput
from services.common.proto.pagestream.internal.v1 import image_pb2
from services.common.sampling_params import SamplingParams


def test_round_trip_keeps_every_array():
    pixels = np.random.RandomState(0).rand(1, 2, 3, 4, 4).astype(np.float32)
    mask = np.ones((1, 2, 4, 4), bool)
    image = ImageInput(2, 5, 4, "abc", {"pixel_values": pixels, "pixel_attention_mask": mask})
    request = EngineCoreRequest("r", list(range(10)), SamplingParams(), images=(image,))
    back = engine_request_from_pb(engine_request_to_pb(request))
    (got,) = back.images
    assert (got.offset, got.length, got.num_embeds, got.content_hash) == (2, 5, 4, "abc")
    assert np.array_equal(got.data["pixel_values"], pixels)
    assert got.data["pixel_values"].dtype == np.float32
    assert np.array_equal(got.data["pixel_attention_mask"], mask)


@pytest.mark.parametrize(
    ("dtype", "shape", "size", "message"),
    [
        ("object", (1,), 8, "dtype 'object'"),
        ("float32", (2, 2), 12, "12 bytes do not hold shape"),
        ("float32", (1,) * 7, 4, "is not an array's shape"),
        ("float32", (-1, 4), 16, "is not an array's shape"),
    ],
)
def test_hostile_arrays_are_refused(dtype, shape, size, message):
    bad = image_pb2.Array(dtype=dtype, shape=shape, data=b"\0" * size)
    with pytest.raises(ValueError, match=message):
        array_from_pb("pixel_values", bad)


def test_too_many_arrays_and_bad_spans_are_refused():
    arrays = {f"a{i}": array_to_pb(np.zeros(1, np.float32)) for i in range(9)}
    with pytest.raises(ValueError, match="9 arrays"):
        images_from_pb([image_pb2.ImageInput(offset=0, length=1, num_embeds=1, data=arrays)])
    for span in [ImageInput(8, 4, 4, "h"), ImageInput(0, 2, 3, "h"), ImageInput(-1, 2, 2, "h")]:
        with pytest.raises(ValueError, match="span"):
            EngineCoreRequest("r", list(range(10)), SamplingParams(), images=(span,))
    overlapping = (ImageInput(0, 4, 4, "a"), ImageInput(2, 4, 4, "b"))
    with pytest.raises(ValueError, match="disjoint"):
        EngineCoreRequest("r", list(range(10)), SamplingParams(), images=overlapping)
