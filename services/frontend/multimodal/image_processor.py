"""ImageProcessor: a vision-language model's HF processor, as the frontend uses it.

Each image marker of a prompt (the processor's `image_token`, one token of the tokenizer)
is replaced by the tokens the processor expands that one image to, and the processor's
tensors for that image alone (with the batch dims of a one-image call) become its
ImageInput's data. Splicing per image equals the processor's whole-prompt output because
every family's expansion starts and ends with an added token (LLaVA's <image>,
Idefics3's <fake_token_around_image>): the text between markers tokenizes the same either
way (tests/frontend/test_image_inputs.py checks it). Blocking: callers run it off the
event loop.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import numpy as np

from services.common.image_input import ImageInput
from services.frontend.multimodal.merged_patch_processor import MergedPatchProcessor

logger = logging.getLogger(__name__)
# The processor's outputs that are the text's, not the image's.
TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
NO_IMAGES = "this model does not take images (it has no image processor)"


class ImageProcessor:
    def __init__(self, processor, image_token_id: int) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.marker = processor.image_token  # what a prompt's text holds, once per image
        self.marker_id = self.tokenizer.convert_tokens_to_ids(self.marker)
        self.image_token_id = image_token_id  # the positions the encoder's rows replace
        # A fast tokenizer must not be called from two threads at once (padding and
        # truncation settings are its state): requests process their images in threads.
        self._lock = threading.Lock()

    @classmethod
    def from_folder(cls, folder: str | Path) -> ImageProcessor | None:
        """The model's image processor; None for a text-only model (or one whose
        processor this frontend cannot use, with a warning)."""
        from transformers import AutoConfig, AutoProcessor

        if not any((Path(folder) / name).is_file() for name in PROCESSOR_FILES):
            return None  # a text model: not worth a second tokenizer load to find out
        try:
            processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
        except ImportError as exc:  # Qwen2.5-VL's wants torchvision, for its videos only
            processor = MergedPatchProcessor.from_folder(folder)
            if processor is None:
                logger.warning("%s: the model's processor cannot load (%s); no images", folder, exc)
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        marker = getattr(processor, "image_token", None)
        if not hasattr(processor, "image_processor") or not isinstance(marker, str):
            return None  # a tokenizer alone, or a processor without images
        token_id = getattr(processor, "image_token_id", None)
        if token_id is None:
            config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
            token_id = getattr(config, "image_token_id", getattr(config, "image_token_index", None))
        ids = processor.tokenizer.encode(marker, add_special_tokens=False)
        if token_id is None or len(ids) != 1:
            logger.warning("%s: image marker %r is not one token; no images", folder, marker)
            return None
        return cls(processor, int(token_id))

    def process(
        self, text: str, images: list, add_special_tokens: bool = True
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids, each marker expanded, and one ImageInput per image."""
        with self._lock:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return self.expand(ids, images)

    def expand(self, ids: list[int], images: list) -> tuple[list[int], tuple[ImageInput, ...]]:
        """`ids` with the i-th marker replaced by image i's tokens."""
        num_markers = ids.count(self.marker_id)
        if num_markers != len(images):
            raise ValueError(
                f"the prompt has {num_markers} image marker(s) ({self.marker}) for "
                f"{len(images)} image(s); each image needs one marker where it goes."
            )
        out: list[int] = []
        inputs = []
        pending = iter(images)
        for token in ids:
            if token != self.marker_id:
                out.append(token)
                continue
            expansion, data = self._one(next(pending))
            inputs.append(_image_input(len(out), expansion, data, self.image_token_id))
            out += expansion
        if out.count(self.image_token_id) != sum(i.num_embeds for i in inputs):
            raise ValueError(
                "the prompt's text contains the model's image token outside an image's place."
            )
        return out, tuple(inputs)

    def _one(self, image) -> tuple[list[int], dict[str, np.ndarray]]:
        """One image's tokens and tensors, as the processor makes them for it alone."""
        try:
            out = self.processor(
                text=self.marker, images=[image], return_tensors="np", add_special_tokens=False
            )
        except (ValueError, TypeError, RuntimeError, IndexError, ZeroDivisionError) as exc:
            raise ValueError(f"image: the model's image processor refused it: {exc}") from None
        expansion = [int(t) for t in out["input_ids"][0]]
        data = {k: np.asarray(v) for k, v in out.items() if k not in TEXT_KEYS}
        return expansion, data


def _image_input(
    base: int, expansion: list[int], data: dict[str, np.ndarray], image_token_id: int
) -> ImageInput:
    """The span from the expansion's first to its last image token, placed at `base`."""
    positions = [i for i, t in enumerate(expansion) if t == image_token_id]
    if not positions:
        raise ValueError("the image processor expanded an image to no image tokens.")
    first, last = positions[0], positions[-1]
    return ImageInput(
        offset=base + first,
        length=last - first + 1,
        num_embeds=len(positions),
        content_hash=content_hash(data),
        data=data,
    )


def content_hash(data: dict[str, np.ndarray]) -> str:
    """sha256 over the arrays (name, dtype, shape, bytes, by name): equal pixels processed
    the same way hash equal."""
    digest = hashlib.sha256()
    for name in sorted(data):
        array = np.ascontiguousarray(data[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()
