"""POST /v1/embeddings: one pooled, normalized vector per input (a --runner pooling engine).

Inputs are a string, a list of strings, a list of token ids or a list of such lists; each
becomes its own engine request, run side by side (Frontend.encode_many). `dimensions`
truncates a Matryoshka model's embeddings; `encoding_format` base64 sends each vector as
the base64 of its little-endian float32 bytes (what the openai client asks for by default).
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.common.pooling_params import PoolingParams
from services.common.request_options import RequestOptions
from services.frontend.openai.errors import InvalidRequestError
from services.frontend.openai.protocol import EmbeddingRequest
from services.frontend.openai.replies import (
    EmbeddingData,
    EmbeddingResponse,
    EmbeddingUsage,
    random_id,
)
from services.frontend.openai.serving_base import ClientDisconnectedError, ServingBase


class OpenAIServingEmbedding(ServingBase):
    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        model = self.check_pooling_model(request.model)
        if self.frontend.input_processor.pooler.num_labels:
            raise InvalidRequestError(
                f"the model {model!r} is a cross-encoder: it scores text pairs "
                "(/v1/score, /rerank) and gives no embeddings.",
                "model",
            )
        request.check()
        prompts = request.prompts()
        self.limits.check_prompts(len(prompts), param="input")
        for prompt in prompts:  # token ids over the context are fine when truncated
            if isinstance(prompt, str) or request.truncate_prompt_tokens is None:
                self.check_prompt_size(prompt, "input")
        params = self._params(request)
        request_id = random_id("embd")
        outputs = await self.embed(
            prompts, params, request_id, raw_request, request.priority, request.add_special_tokens
        )
        if outputs is None:
            return Response(status_code=499)
        data = [
            EmbeddingData(index=i, embedding=_encode(o.outputs.data, request.encoding_format))
            for i, o in enumerate(outputs)
        ]
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        body = EmbeddingResponse(
            id=request_id,
            model=model,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(body.model_dump())

    def check_pooling_model(self, model_name: str | None, what: str = "embeddings") -> str:
        """The served model's name, which must run the pooling runner."""
        model = self.check_model(model_name)
        if self.frontend.input_processor.pooler is None:
            raise InvalidRequestError(
                f"the model {model!r} runs with --runner generate: it does not serve "
                f"{what}; start the server with --runner pooling.",
                "model",
            )
        return model

    async def embed(
        self,
        prompts: list[str | list[int]],
        params: PoolingParams,
        request_id: str,
        raw_request: Request,
        priority: int = 0,
        add_special_tokens: bool = True,
        field: str = "input",
    ) -> list | None:
        """Every prompt's pooled output, in order (None: the client went away); errors of
        the inputs name `field`."""
        recorder = self.metrics.start_request()
        work = self.frontend.encode_many(
            [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts],
            params,
            request_id,
            RequestOptions(priority=priority, add_special_tokens=add_special_tokens),
        )
        try:
            outputs = await self.until_disconnected(raw_request, self._named(work, field))
        except ClientDisconnectedError:
            recorder.finish([None] * len(prompts))
            return None
        for output in outputs:
            recorder.on_prompt(len(output.prompt_token_ids))
        recorder.finish(["stop"] * len(outputs))
        return outputs

    @staticmethod
    def _params(request: EmbeddingRequest) -> PoolingParams:
        try:
            return PoolingParams(
                dimensions=request.dimensions,
                normalize=request.normalize,
                truncate_prompt_tokens=request.truncate_prompt_tokens,
                prompt_name=request.prompt_name,
            )
        except ValueError as exc:
            param = "truncate_prompt_tokens" if "truncate" in str(exc) else "dimensions"
            raise InvalidRequestError(str(exc), param) from exc

    @staticmethod
    async def _named(work, field: str):
        """Errors of the inputs name `field` (ValueErrors are the request's)."""
        try:
            return await work
        except InvalidRequestError:
            raise
        except ValueError as exc:
            param = next((p for p in _PARAMS if str(exc).startswith(p)), field)
            code = getattr(exc, "code", None) or "invalid_value"
            raise InvalidRequestError(str(exc), param, code) from exc


_PARAMS = ("dimensions", "prompt_name", "truncate_prompt_tokens")  # errors that name them


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()
