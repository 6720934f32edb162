"""InputProcessor: a prompt and its sampling parameters -> a validated engine request.

`make_request` is the one place a request is built on the frontend side (the offline
LLMEngine and the serving Frontend both call it, with the request's RequestOptions; a
PoolingParams makes a pooling request): the prompt is tokenized and checked
against the context length and the vocabulary, the parameters against the vocabulary and
the grammar compiler, and it returns the EngineCoreRequest to send and the RequestState
that detokenizes its outputs. Bad input raises ValueError naming the field, before
anything is admitted. A prompt with images ({"prompt": text, "multi_modal_data":
{"image": [PIL images]}}) is expanded by the model's ImageProcessor into token ids and one
ImageInput per image; a prompt already expanded carries its ImageInputs ("images").
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from services.common.engine_request import EngineCoreRequest
from services.common.image_input import ImageInput, check_images
from services.common.pooling_params import PoolingParams
from services.common.request_options import DEFAULT_OPTIONS, RequestOptions
from services.common.sampling_params import SamplingParams
from services.common.served_model_info import ServedModelInfo
from services.common.structured_outputs import check_grammar
from services.frontend.lora_registry import LoRARegistry
from services.frontend.multimodal.image_processor import NO_IMAGES, ImageProcessor
from services.frontend.pooling_request_state import PoolingRequestState
from services.frontend.request_limits import CONTEXT_LENGTH_EXCEEDED
from services.frontend.request_state import RequestState


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


class ContextLengthExceededError(ValueError):
    """A prompt longer than the model's context (OpenAI's code: context_length_exceeded,
    which clients match to trim their history)."""

    code = CONTEXT_LENGTH_EXCEEDED


@dataclass(frozen=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    images: tuple[ImageInput, ...] = ()  # in prompt order, spans within prompt_token_ids


class InputProcessor:
    def __init__(self, tokenizer, info: ServedModelInfo, images: ImageProcessor | None = None):
        """`images`: a vision-language model's image processor (None: no images)."""
        self.tokenizer = tokenizer
        self.images = images
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.eos_token_ids = info.eos_token_ids
        self.loras = LoRARegistry(info.capabilities.lora, info.capabilities.lora_targets)
        # The pooling runner's pooler (None: the engine generates).
        self.pooler = info.capabilities.pooler
        self.can_generate = info.capabilities.can_generate

    def make_request(
        self,
        request_id: str | None,
        prompt,
        params: SamplingParams | PoolingParams,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> tuple[EngineCoreRequest, RequestState | PoolingRequestState]:
        """The engine request and its frontend state (a fresh id when none is given): a
        generation for SamplingParams, a pooling request (an embedding) for PoolingParams."""
        request_id = request_id or new_request_id()
        if isinstance(params, PoolingParams):
            return self._pooling_request(request_id, prompt, params, options)
        if not self.can_generate:
            raise ValueError(
                "this model runs with --runner pooling and its checkpoint has no LM head: it "
                "serves embeddings (/v1/embeddings, LLM.embed), not generation."
            )
        processed = self.process(prompt, options.add_special_tokens)
        self.check_params(params)
        lora = options.lora_request
        if lora is not None:
            lora = self.loras.check(lora)
        eos = self.eos_token_ids
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=processed.prompt_token_ids,
            sampling_params=params,
            eos_token_id=eos[0] if eos else None,
            extra_stop_token_ids=tuple(eos[1:]),
            priority=options.priority,
            cache_salt=options.cache_salt,
            lora_request=lora,
            images=processed.images,
        )
        state = RequestState(
            request_id, processed.prompt, processed.prompt_token_ids, params, self.tokenizer
        )
        return request, state

    def _pooling_request(
        self, request_id: str, prompt, params: PoolingParams, options: RequestOptions
    ) -> tuple[EngineCoreRequest, PoolingRequestState]:
        if self.pooler is None:
            raise ValueError(
                "this model runs with --runner generate: it does not serve embeddings; start "
                "it with --runner pooling (and --pooler-config to choose how it pools)."
            )
        if options.lora_request is not None:
            raise ValueError("a pooling request (an embedding, a score) runs no LoRA adapter.")
        params.verify(self.pooler)
        keep = params.truncate_prompt_tokens
        keep_last = self.max_model_len if keep == -1 else keep
        if isinstance(prompt, dict) and (prompt.get("images") or "multi_modal_data" in prompt):
            raise ValueError("a pooling request (an embedding, a score) takes no images.")
        prefix = self.pooler.prompt_text(params.prompt_name)
        text = _prompt_text(prompt)
        add_special_tokens = options.add_special_tokens
        if text is not None and self.pooler.chat_template_inputs and self._has_chat_template():
            prompt, add_special_tokens = self._as_message(text, prefix), False
        elif text is not None:
            prompt = prefix + text
        processed = self.process(prompt, add_special_tokens, keep_last)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=processed.prompt_token_ids,
            priority=options.priority,
            cache_salt=options.cache_salt,
            pooling_params=params,
        )
        state = PoolingRequestState(request_id, processed.prompt, processed.prompt_token_ids)
        return request, state

    def _has_chat_template(self) -> bool:
        return getattr(self.tokenizer, "chat_template", None) is not None

    def _as_message(self, text: str, system: str) -> str:
        """A pooling text as sentence-transformers 6 renders it for a "message" model: a
        user message (after a system message holding the named prompt, if any) through the
        chat template, without a generation prompt."""
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": text})
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False
        )

    def process(
        self, prompt, add_special_tokens: bool = True, keep_last: int | None = None
    ) -> ProcessedPrompt:
        """Accepts a str, {"prompt": str}, {"prompt_token_ids": [...]} or a list of ids;
        `keep_last`: only its last tokens count (vLLM's truncate_prompt_tokens).

        Chat prompts pass add_special_tokens=False: their template already has the BOS.
        """
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids, images = prompt["prompt_token_ids"], tuple(prompt.get("images") or ())
                return self._check(prompt.get("prompt"), ids, keep_last, images)
            if "multi_modal_data" in prompt:
                return self._with_images(prompt, add_special_tokens, keep_last)
            if "prompt" in prompt:
                return self.process(prompt["prompt"], add_special_tokens, keep_last)
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass prompt_token_ids instead.")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            return self._check(prompt, ids, keep_last)
        if isinstance(prompt, list | tuple):
            return self._check(None, prompt, keep_last)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt)}.")

    def _with_images(self, prompt: dict, add_special_tokens: bool, keep_last) -> ProcessedPrompt:
        """vLLM's {"prompt": text with the model's image markers, "multi_modal_data":
        {"image": image or [images]}}: the images decoded already (RGB PIL images)."""
        data, text = prompt["multi_modal_data"], prompt.get("prompt")
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError('multi_modal_data must be {"image": an image or a list of images}.')
        images = data.get("image")
        images = [] if images is None else images if isinstance(images, list | tuple) else [images]
        if not images:
            return self.process(text, add_special_tokens, keep_last)
        if self.images is None:
            raise ValueError(NO_IMAGES + ".")
        if not isinstance(text, str):
            raise ValueError("a prompt with images needs its text in 'prompt'.")
        ids, inputs = self.images.process(text, list(images), add_special_tokens)
        return self._check(text, ids, keep_last, inputs)

    def check_params(self, params) -> None:
        """Token ids in the sampling parameters must exist in this model's vocabulary, and
        a structured-output constraint must compile (ValueError naming the problem)."""
        if params.structured_outputs is not None:
            check_grammar(params.structured_outputs)
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids or []),
            ("logit_bias", list(params.logit_bias or {})),
        ):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"{name} contains token id {bad[0]}, outside the vocabulary "
                    f"[0, {self.vocab_size})."
                )

    def _check(
        self, text: str | None, token_ids, keep_last: int | None = None, images: tuple = ()
    ) -> ProcessedPrompt:
        ids = list(token_ids)
        if images and self.images is None:
            raise ValueError(NO_IMAGES + ".")
        if images and keep_last is not None:
            raise ValueError("a prompt with images cannot be truncated (its images' places).")
        if keep_last is not None:
            ids = ids[-keep_last:]
        if not ids:
            raise ValueError("the prompt is empty: it must contain at least one token.")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be integers.")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids contains {bad[0]}, "
                f"outside the vocabulary [0, {self.vocab_size})."
            )
        if len(ids) > self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt has {len(ids)} tokens, more than the maximum context length "
                f"max_model_len={self.max_model_len}."
            )
        check_images(images, len(ids))
        return ProcessedPrompt(text, ids, images)


def _prompt_text(prompt) -> str | None:
    """A text prompt's text (None: token ids)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None
    return None
