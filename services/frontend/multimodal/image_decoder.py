"""decode_image: an image's encoded bytes -> an RGB PIL image, under bounds.

Only allow-listed formats are parsed at all; width x height is read from the header and
checked against --max-image-pixels before any pixel is decoded (a small file can claim a
huge canvas: a decompression bomb); GIF and animated WEBP give their first frame. Every
failure is a ValueError naming it.
"""

from __future__ import annotations

import io
import warnings

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def decode_image(data: bytes, max_pixels: int):
    """The image in `data`, converted to RGB (`max_pixels` 0: no bound but PIL's own)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ValueError("image: its declared size is a decompression bomb.") from None
    except (OSError, SyntaxError, ValueError):
        raise ValueError(
            f"image: not a readable image in a supported format ({', '.join(FORMATS)})."
        ) from None
    width, height = image.size
    if max_pixels and width * height > max_pixels:
        raise ValueError(
            f"image: {width}x{height} is {width * height} pixels, over the limit of "
            f"{max_pixels} (--max-image-pixels)."
        )
    if width < 1 or height < 1:
        raise ValueError(f"image: {width}x{height} has no pixels.")
    try:
        image.seek(0)  # the first frame of a GIF / animated WEBP
        return image.convert("RGB")  # decodes
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ValueError(f"image: its {image.format} data could not be decoded: {exc}") from None
