"""LLM: vLLM's offline API — generate, chat and beam search over a batch of prompts, and
embed / encode on a pooling runner (LLM(model, runner="pooling")). A vision-language model
takes images: chat content parts, or generate's {"prompt", "multi_modal_data"}; the image
options (limit_mm_per_prompt, max_image_pixels, ...) are FrontendConfig's, as keywords."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm import tqdm

from pagestream.engine_args import EngineArgs
from pagestream.llm_engine import LLMEngine
from pagestream.tensor_outputs import as_tensors
from services.common.lora_request import LoRARequest
from services.common.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from services.common.pooling_params import PoolingParams
from services.common.request_options import RequestOptions
from services.common.sampling_defaults import sampling_params_with_defaults
from services.common.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from services.frontend.frontend_config import FrontendConfig
from services.frontend.multimodal.chat_images import split_images
from services.frontend.multimodal.image_loader import ImageLoader
from services.frontend.multimodal.image_processor import NO_IMAGES
from services.frontend.pair_scoring import (
    PairScoring,
    classification_params,
    classifier_pooler,
    pair_texts,
)
from services.frontend.tokenizer import apply_chat_template

# FrontendConfig's options LLM takes as keywords (the rest are EngineArgs').
IMAGE_OPTIONS = (
    "limit_mm_per_prompt",
    "max_image_bytes",
    "max_image_pixels",
    "allowed_local_media_path",
    "allowed_media_domains",
    "media_fetch_timeout_s",
)


class LLM:
    """LLM(model=None, **engine_args): model=None runs the default SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        if model is not None:
            engine_args["model"] = model
        options = {k: engine_args.pop(k) for k in IMAGE_OPTIONS if k in engine_args}
        self.image_loader = ImageLoader(FrontendConfig(**options))  # checked before the load
        self.engine = LLMEngine(EngineArgs.from_kwargs(**engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses without sampling_params: vLLM's defaults, overridden by the
        model's generation_config.json unless generation_config="vllm"."""
        return sampling_params_with_defaults({}, self.engine.default_sampling)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in input order; prompts: a str, a list of str, {"prompt_token_ids": [...]},
        or {"prompt": text with the model's image marker per image, "multi_modal_data":
        {"image": a PIL image, a URL string or a list of them}}.
        lora_request: one adapter for every prompt, or one each (None: the base model)."""
        prompts = [self._load_images(p) for p in _as_list(prompts)]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm, _loras(lora_request, len(prompts)))

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations;
        `chat_template_kwargs`: the template's own variables ({"enable_thinking": False})."""
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer, and this model folder has none.")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            conversation, images = split_images(conversation)
            text = apply_chat_template(
                self.engine.tokenizer,
                conversation,
                add_generation_prompt,
                chat_template,
                template_kwargs=chat_template_kwargs,
            )
            prompt = {"prompt": text, "multi_modal_data": {"image": images}}
            prompts.append(self._load_images(prompt) if images else text)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _params_per_prompt(sampling_params, len(prompts))
        loras = _loras(lora_request, len(prompts))
        return self._run(prompts, params, use_tqdm, loras, add_special_tokens=False)

    def _load_images(self, prompt):
        """A prompt's images as RGB PIL images, within the image options (the prompt as
        is when it has none)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        images = data.get("image") if isinstance(data, dict) else None
        if images is None:
            return prompt
        if self.engine.images is None:
            raise ValueError(NO_IMAGES + ".")
        images = list(images) if isinstance(images, list | tuple) else [images]
        return {**prompt, "multi_modal_data": {**data, "image": self.image_loader.load_all(images)}}

    def beam_search(
        self, prompts, params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Beam search inside the engine (beams share KV blocks, fork and free as they are
        pruned); each output holds the beam_width best sequences, best first, with their
        cumulative logprobs. Matches HF generate(num_beams=beam_width, do_sample=False)."""
        return self.generate(prompts, params.to_sampling_params(), use_tqdm)

    def embed(
        self,
        prompts,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        prompt_name: str | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order: the pooled state, truncated to
        `dimensions` (Matryoshka models) and L2-normalized as the pooler config (or
        `normalize`) says; `truncate_prompt_tokens` keeps each prompt's last k tokens (-1:
        the context length); `prompt_name` puts one of the model's sentence-transformers
        prompts ("query", "document", ...) before each text. Needs runner="pooling"."""
        if pooling_params is None:
            pooling_params = PoolingParams(
                dimensions=dimensions,
                normalize=normalize,
                truncate_prompt_tokens=truncate_prompt_tokens,
                prompt_name=prompt_name,
            )
        outputs = self._pool(prompts, pooling_params, "embed", use_tqdm)
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: each pair's relevance, text_1 against every text_2 (one
        text_1) or pairwise: a cross-encoder's score of the pair read together (its logit
        through the checkpoint's activation), or an embedding model's cosine of the two
        normalized embeddings."""
        engine = self.engine
        plan = PairScoring.plan(
            pair_texts(text_1, text_2),
            engine.input_processor.pooler,
            engine.tokenizer,
            truncate_prompt_tokens,
        )
        prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in plan.prompts]
        outputs = self._pool(prompts, plan.params, "embed", use_tqdm)
        return [
            ScoringRequestOutput(
                pooled[0].request_id,
                ScoringOutput(plan.score(pooled)),
                [t for o in pooled for t in o.prompt_token_ids],
            )
            for pooled in plan.per_pair(outputs)
        ]

    def classify(
        self, prompts, use_tqdm: bool = True, *, truncate_prompt_tokens: int | None = None
    ) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify: each prompt's label probabilities from a classification
        checkpoint (`*ForSequenceClassification`): a softmax over its labels' logits, a
        sigmoid for one label."""
        pooler = classifier_pooler(self.engine.input_processor.pooler)
        params = classification_params(truncate_prompt_tokens)
        return [
            ClassificationRequestOutput(
                o.request_id,
                ClassificationOutput(pooler.probabilities(o.outputs.data)),
                o.prompt_token_ids,
            )
            for o in self._pool(prompts, params, "embed", use_tqdm)
        ]

    def encode(
        self,
        prompts,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """The raw pooled hidden state of each prompt (`outputs.data`, a [hidden] float32
        torch tensor, as vLLM's), neither truncated nor normalized. Needs runner="pooling"."""
        if pooling_params is None:
            pooling_params = PoolingParams(
                task="encode", truncate_prompt_tokens=truncate_prompt_tokens
            )
        return [as_tensors(o) for o in self._pool(prompts, pooling_params, "encode", use_tqdm)]

    def _pool(
        self, prompts, pooling_params, task: str, use_tqdm: bool
    ) -> list[PoolingRequestOutput]:
        prompts = _as_list(prompts)
        params = _per_prompt(pooling_params, len(prompts), PoolingParams, "pooling_params")
        engine, ids = self.engine, []
        try:
            for prompt, pp in zip(prompts, params, strict=True):
                if pp.task != task:
                    raise ValueError(f"LLM.{task} got pooling_params with task {pp.task!r}.")
                ids.append(engine.add_request(None, prompt, pp).request_id)
        except ValueError:
            engine.abort_request(ids)
            raise
        outputs = self._collect(ids, use_tqdm)
        failed = [o for o in outputs if o.outputs is None]
        if failed:
            raise RuntimeError(f"{len(failed)} pooling request(s) failed: {failed[0].error}")
        return outputs

    def _run(self, prompts, params, use_tqdm: bool, loras=None, add_special_tokens: bool = True):
        engine = self.engine
        ids = []
        loras = loras or [None] * len(prompts)
        try:
            for prompt, sp, lora in zip(prompts, params, loras, strict=True):
                final = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                options = RequestOptions(add_special_tokens=add_special_tokens, lora_request=lora)
                state = engine.add_request(None, prompt, final, options)
                ids.append(state.request_id)
        except ValueError:
            engine.abort_request(ids)
            raise
        return self._collect(ids, use_tqdm)

    def _collect(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        # Only these requests' outputs: a call refused after admitting some of its prompts
        # left their aborts' final outputs for the next step (see _run).
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        start, num_tokens = time.perf_counter(), 0
        while len(results) < len(ids) and self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished and output.request_id in wanted:
                    results[output.request_id] = output
                    num_tokens += _num_tokens(output)
                    bar.update(1)
                    rate = num_tokens / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"output {rate:.1f} tok/s")
        bar.close()
        return [results[i] for i in ids]


def _num_tokens(output) -> int:
    """Tokens generated (a pooling request: the prompt tokens it read)."""
    if isinstance(output, RequestOutput):
        return sum(len(o.token_ids) for o in output.outputs)
    return len(output.prompt_token_ids)


def _as_list(prompts) -> list:
    if isinstance(prompts, str | dict):
        return [prompts]
    return list(prompts)


def _loras(lora_request, num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(
            f"got {len(loras)} lora_requests for {num_prompts} prompts; give one or one each."
        )
    return loras


def _params_per_prompt(params, num_prompts: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(num_prompts)]
    return _per_prompt(params, num_prompts, SamplingParams, "sampling_params")


def _per_prompt(params, num_prompts: int, kind: type, name: str) -> list:
    if isinstance(params, kind):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(
            f"got {len(params)} {name} for {num_prompts} prompts; give one or one each."
        )
    return params
