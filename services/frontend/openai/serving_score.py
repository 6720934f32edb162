"""POST /v1/score and the rerank routes (/rerank, /v1/rerank, /v2/rerank) of an embedding
model: relevance as the cosine of two texts' embeddings (a bi-encoder, as vLLM scores with
an embedding model).

Each distinct text is embedded once (normalized: the score is their dot product); the
score body is vLLM's (`text_1` against `text_2`: one against many, or pairwise), the rerank
body Jina's / Cohere's (`query`, `documents` as strings or {"text": ...}, `top_n`,
`return_documents`), its results by relevance, best first.
"""

from __future__ import annotations

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.common.pooling_params import PoolingParams
from services.frontend.openai.errors import InvalidRequestError
from services.frontend.openai.protocol import RerankRequest, ScoreRequest
from services.frontend.openai.responses import (
    EmbeddingUsage,
    RerankResponse,
    RerankResult,
    RerankResultDocument,
    RerankUsage,
    ScoreData,
    ScoreResponse,
    random_id,
)
from services.frontend.openai.serving_embedding import OpenAIServingEmbedding


class OpenAIServingScores:
    def __init__(self, embedding: OpenAIServingEmbedding) -> None:
        self.embedding = embedding  # scores are computed from its embeddings

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        model = self.embedding.check_pooling_model(request.model, "scores")
        pairs = request.pairs()
        request_id = random_id("score")
        embedded = await self._embed(
            [text for pair in pairs for text in pair], request, request_id, raw_request, "text_1"
        )
        if embedded is None:
            return Response(status_code=499)
        vectors, num_tokens = embedded
        data = [
            ScoreData(index=i, score=float(vectors[a] @ vectors[b]))
            for i, (a, b) in enumerate(pairs)
        ]
        usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        body = ScoreResponse(id=request_id, model=model, data=data, usage=usage)
        return JSONResponse(body.model_dump())

    async def rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        model = self.embedding.check_pooling_model(request.model, "reranking")
        documents = request.texts()
        request_id = random_id("rerank")
        embedded = await self._embed(
            [request.query, *documents], request, request_id, raw_request, "documents"
        )
        if embedded is None:
            return Response(status_code=499)
        vectors, num_tokens = embedded
        query = vectors[request.query]
        scores = [float(query @ vectors[text]) for text in documents]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[: request.top_n]
        results = [
            RerankResult(
                index=i,
                document=RerankResultDocument(text=documents[i])
                if request.return_documents
                else None,
                relevance_score=scores[i],
            )
            for i in order
        ]
        usage = RerankUsage(total_tokens=num_tokens)
        body = RerankResponse(id=request_id, model=model, usage=usage, results=results)
        return JSONResponse(body.model_dump(exclude_none=True))

    async def _embed(
        self,
        texts: list[str],
        request: ScoreRequest | RerankRequest,
        request_id: str,
        raw_request: Request,
        field: str,
    ) -> tuple[dict[str, np.ndarray], int] | None:
        """Each distinct text's normalized embedding, and the tokens of them all."""
        distinct = list(dict.fromkeys(texts))
        for text in distinct:
            self.embedding.check_prompt_size(text, field)
        try:
            params = PoolingParams(
                normalize=True, truncate_prompt_tokens=request.truncate_prompt_tokens
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "truncate_prompt_tokens") from exc
        outputs = await self.embedding.embed(
            distinct, params, request_id, raw_request, request.priority, field=field
        )
        if outputs is None:
            return None
        vectors = {
            text: np.asarray(o.outputs.data, np.float64)
            for text, o in zip(distinct, outputs, strict=True)
        }
        counts = {text: len(o.prompt_token_ids) for text, o in zip(distinct, outputs, strict=True)}
        return vectors, sum(counts[text] for text in texts)
