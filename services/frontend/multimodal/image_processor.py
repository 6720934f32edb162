"""ImageProcessor: a vision-language model's HF processor, as the frontend uses it.

Each image marker of a prompt (the processor's `image_token`, one token of the tokenizer)
is replaced by the tokens the processor expands that one image to, and the processor's
tensors for that image alone (with the batch dims of a one-image call) become its
ImageInput's data. Where an expansion starts and ends with an added token (LLaVA's
<image>, Idefics3's <fake_token_around_image>) its ids are spliced in: the text between
markers tokenizes the same either way; else (Gemma 3's newlines) the expanded text is
tokenized whole, as the processor does. Either equals the processor's whole-prompt output
(tests/frontend/test_image_inputs.py). Blocking: callers run it off the event loop.
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
        self._added = frozenset(self.tokenizer.added_tokens_decoder)
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
        # The config's id first: Gemma 3's processor calls its marker (<start_of_image>)
        # its image token, while the encoder's rows go to the soft tokens after it.
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        token_id = getattr(config, "image_token_id", None)
        if token_id is None:
            token_id = getattr(config, "image_token_index", None)
        if token_id is None:
            token_id = getattr(processor, "image_token_id", None)
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
            num_markers = ids.count(self.marker_id)
            if num_markers != len(images):
                raise ValueError(
                    f"the prompt has {num_markers} image marker(s) ({self.marker}) for "
                    f"{len(images)} image(s); each image needs one marker where it goes."
                )
            ones = [self._one(image) for image in images]
            if all(self._between_added_tokens(expansion) for expansion, _ in ones):
                ids = self._spliced(ids, [expansion for expansion, _ in ones])
            else:
                ids = self._retokenized(text, [e for e, _ in ones], add_special_tokens)
            return ids, self._image_inputs(ids, ones)

    def _between_added_tokens(self, expansion: list[int]) -> bool:
        """Whether the expansion starts and ends with an added token: the text around it
        then tokenizes the same beside it as beside the marker."""
        return expansion[0] in self._added and expansion[-1] in self._added

    def _spliced(self, ids: list[int], expansions: list[list[int]]) -> list[int]:
        """`ids` with the i-th marker replaced by image i's tokens."""
        out: list[int] = []
        pending = iter(expansions)
        for token in ids:
            out += next(pending) if token == self.marker_id else [token]
        return out

    def _retokenized(self, text: str, expansions: list[list[int]], add_special_tokens: bool):
        """The text with each marker replaced by its image's expansion text, tokenized
        whole, as the processor does (Gemma 3's expansion starts and ends with newlines,
        which merge with the text beside them)."""
        pieces = text.split(self.marker)
        if len(pieces) != len(expansions) + 1:
            raise ValueError(f"the prompt's image markers ({self.marker}) are not separate.")
        out = pieces[0]
        for expansion, piece in zip(expansions, pieces[1:], strict=True):
            out += self.tokenizer.decode(
                expansion, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            out += piece
        return self.tokenizer.encode(out, add_special_tokens=add_special_tokens)

    def _image_inputs(self, ids: list[int], ones: list) -> tuple[ImageInput, ...]:
        """Image i owns the next as many image tokens as its expansion holds: its span
        runs from the first of them to the last."""
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        counts = [expansion.count(self.image_token_id) for expansion, _ in ones]
        if len(positions) != sum(counts):
            raise ValueError(
                "the prompt's text contains the model's image token outside an image's place."
            )
        inputs, start = [], 0
        for count, (_, data) in zip(counts, ones, strict=True):
            if count == 0:
                raise ValueError("the image processor expanded an image to no image tokens.")
            first, last = positions[start], positions[start + count - 1]
            start += count
            inputs.append(ImageInput(first, last - first + 1, count, content_hash(data), data))
        return tuple(inputs)

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


def content_hash(data: dict[str, np.ndarray]) -> str:
    """sha256 over the arrays (name, dtype, shape, bytes, by name): equal pixels processed
    the same way hash equal."""
    digest = hashlib.sha256()
    for name in sorted(data):
        array = np.ascontiguousarray(data[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()
