"""ImageLoader: a request's images (URLs, encoded bytes or PIL images) -> RGB PIL images.

The count is checked against --limit-mm-per-prompt before anything is read; then each
image is loaded (MediaLoader) and decoded (decode_image) within the byte and pixel
bounds. Blocking: the serving paths call it in a thread (asyncio.to_thread).
"""

from __future__ import annotations

from services.frontend.multimodal.image_decoder import decode_image
from services.frontend.multimodal.media_loader import MediaLoader


class ImageLoader:
    def __init__(self, config) -> None:
        """`config`: a FrontendConfig (its image limits and media rules)."""
        self.limit = config.image_limit
        self.max_pixels = config.max_image_pixels
        self.media = MediaLoader.of(config)

    def check_count(self, count: int) -> None:
        if count > self.limit:
            raise ValueError(
                f"the request has {count} images, more than the limit of {self.limit} per "
                "prompt (limit_mm_per_prompt, --limit-mm-per-prompt)."
            )

    def load_all(self, sources: list) -> list:
        """Every image, in order (ValueError naming the first bad one)."""
        self.check_count(len(sources))
        return [self.load(source) for source in sources]

    def load(self, source):
        if isinstance(source, str):
            return decode_image(self.media.load(source), self.max_pixels)
        if isinstance(source, bytes):  # the public gRPC API's image bytes
            self.media.check_size(len(source), "the image")
            return decode_image(source, self.max_pixels)
        if hasattr(source, "convert") and hasattr(source, "size"):  # a PIL image, given
            width, height = source.size
            if self.max_pixels and width * height > self.max_pixels:
                raise ValueError(
                    f"image: {width}x{height} is over the limit of {self.max_pixels} pixels "
                    "(max_image_pixels)."
                )
            return source.convert("RGB")
        raise ValueError(f"image: expected a URL string or a PIL image, got {type(source)}.")
