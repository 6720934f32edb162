"""ImageInput <-> image.proto: an image's span, hash and processor tensors between processes.

Decoding checks what the sender controls before anything is allocated: the dtype from an
allow-list, the rank, the shape against the bytes, and how many arrays an image carries.
"""

from __future__ import annotations

import math

import numpy as np

from services.common.image_input import ImageInput
from services.common.proto.pagestream.internal.v1 import image_pb2

# The dtypes HF image processors produce (pixels, masks, sizes, grids).
_DTYPES = frozenset({"float32", "float16", "float64", "int64", "int32", "uint8", "bool"})
MAX_ARRAYS = 8  # per image
MAX_RANK = 6


def images_to_pb(images: tuple[ImageInput, ...]) -> list[image_pb2.ImageInput]:
    return [
        image_pb2.ImageInput(
            offset=image.offset,
            length=image.length,
            num_embeds=image.num_embeds,
            content_hash=image.content_hash,
            data={name: array_to_pb(array) for name, array in image.data.items()},
        )
        for image in images
    ]


def images_from_pb(messages) -> tuple[ImageInput, ...]:
    return tuple(_image_from_pb(i, message) for i, message in enumerate(messages))


def _image_from_pb(index: int, message: image_pb2.ImageInput) -> ImageInput:
    if len(message.data) > MAX_ARRAYS:
        raise ValueError(f"images[{index}] carries {len(message.data)} arrays, over {MAX_ARRAYS}")
    data = {name: array_from_pb(f"images[{index}].{name}", a) for name, a in message.data.items()}
    return ImageInput(
        offset=message.offset,
        length=message.length,
        num_embeds=message.num_embeds,
        content_hash=message.content_hash,
        data=data,
    )


def array_to_pb(array: np.ndarray) -> image_pb2.Array:
    array = np.ascontiguousarray(array)
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return image_pb2.Array(dtype=array.dtype.name, shape=array.shape, data=little.tobytes())


def array_from_pb(name: str, message: image_pb2.Array) -> np.ndarray:
    if message.dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype {message.dtype!r} is not one of {sorted(_DTYPES)}")
    shape = tuple(message.shape)
    if len(shape) > MAX_RANK or any(d < 0 for d in shape):
        raise ValueError(f"{name}: shape {shape} is not an array's shape")
    dtype = np.dtype(message.dtype).newbyteorder("<")
    if math.prod(shape) * dtype.itemsize != len(message.data):
        raise ValueError(f"{name}: {len(message.data)} bytes do not hold shape {shape}")
    return (
        np.frombuffer(message.data, dtype)
        .astype(dtype.newbyteorder("="), copy=False)
        .reshape(shape)
    )
