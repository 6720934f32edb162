"""ModelFiles: what a frontend reads from the model's folder, read once at start.

Every layout that tokenizes (LLMEngine, AsyncEngine's engine-core-process layout, the
frontend role) loads these here, so the tokenizer, the sampling defaults
(--generation-config, generation_defaults.py) and a vision-language model's image processor
(multimodal/image_processor.py) come from the same folder by one rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.model_source import resolve_model
from services.frontend.generation_defaults import load_generation_defaults

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from services.frontend.multimodal.image_processor import ImageProcessor


@dataclass(frozen=True)
class ModelFiles:
    folder: Path  # the model's HF folder (a GGUF file is converted once, by resolve_model)
    tokenizer: PreTrainedTokenizerBase | None  # None: token-id prompts only, no output text
    default_sampling: dict  # the values requests that leave them unset get
    images: ImageProcessor | None = None  # None: a text model, requests with images refused

    @classmethod
    def load(
        cls, model: str, generation_config: str = "auto", require_tokenizer: bool = False
    ) -> ModelFiles:
        """The model's files; without a usable tokenizer a TokenizerLoadError where
        `require_tokenizer`, else a warning and None. ValueError names a bad
        generation_config.json or --generation-config folder."""
        # transformers (and torch) load here, not when the engine module is imported
        from services.frontend.multimodal.image_processor import ImageProcessor
        from services.frontend.tokenizer import load_tokenizer, try_load_tokenizer

        folder = resolve_model(model)
        tokenizer = load_tokenizer(folder) if require_tokenizer else try_load_tokenizer(folder)
        images = ImageProcessor.from_folder(folder) if tokenizer is not None else None
        if images is not None and tokenizer.chat_template is None:
            # a VLM's template may live with its processor (chat_template.json) only
            tokenizer.chat_template = images.processor.chat_template
        defaults = load_generation_defaults(folder, generation_config)
        return cls(folder, tokenizer, defaults, images)
