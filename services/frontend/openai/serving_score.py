"""POST /v1/score and the rerank routes (/rerank, /v1/rerank, /v2/rerank): how relevant a
text is to another, from a cross-encoder (the pair read together, its logit through the
checkpoint's activation: a sigmoid for one label, as sentence-transformers' CrossEncoder)
or from an embedding model (the cosine of the two texts' embeddings, as vLLM scores with
one; each distinct text embedded once).

The score body is vLLM's (`text_1` against `text_2`: one against many, or pairwise), the rerank
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
        scored = await self._scores(pairs, request, request_id, raw_request, "text_2")
        if scored is None:
            return Response(status_code=499)
        scores, num_tokens = scored
        data = [ScoreData(index=i, score=score) for i, score in enumerate(scores)]
        usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        body = ScoreResponse(id=request_id, model=model, data=data, usage=usage)
        return JSONResponse(body.model_dump())

    async def rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        model = self.embedding.check_pooling_model(request.model, "reranking")
        documents = request.texts()
        request_id = random_id("rerank")
        pairs = [(request.query, document) for document in documents]
        scored = await self._scores(pairs, request, request_id, raw_request, "documents")
        if scored is None:
            return Response(status_code=499)
        scores, num_tokens = scored
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

    async def _scores(
        self,
        pairs: list[tuple[str, str]],
        request: ScoreRequest | RerankRequest,
        request_id: str,
        raw_request: Request,
        field: str,
    ) -> tuple[list[float], int] | None:
        """Each pair's score and the tokens read (None: the client went away)."""
        for text in dict.fromkeys(text for pair in pairs for text in pair):
            self.embedding.check_prompt_size(text, field)
        pooler = self.embedding.frontend.input_processor.pooler
        try:
            params = PoolingParams(
                normalize=not pooler.num_labels,
                truncate_prompt_tokens=request.truncate_prompt_tokens,
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "truncate_prompt_tokens") from exc
        if pooler.num_labels:
            return await self._cross_scores(pairs, params, request, request_id, raw_request, field)
        distinct = list(dict.fromkeys(text for pair in pairs for text in pair))
        outputs = await self.embedding.embed(
            distinct, params, request_id, raw_request, request.priority, field=field
        )
        if outputs is None:
            return None
        by_text = dict(zip(distinct, outputs, strict=True))
        vectors = {text: np.asarray(o.outputs.data, np.float64) for text, o in by_text.items()}
        scores = [float(vectors[a] @ vectors[b]) for a, b in pairs]
        return scores, sum(len(by_text[t].prompt_token_ids) for pair in pairs for t in pair)

    async def _cross_scores(self, pairs, params, request, request_id, raw_request, field):
        """A cross-encoder reads each pair as its tokenizer joins them; its first logit
        through the checkpoint's activation is the score."""
        pooler = self.embedding.frontend.input_processor.pooler
        if pooler.num_labels != 1:
            raise InvalidRequestError(
                f"the model classifies into {pooler.num_labels} labels: scores need a "
                "cross-encoder with one.",
                "model",
            )
        tokenizer = self.embedding.frontend.tokenizer
        prompts = [tokenizer(a, b)["input_ids"] for a, b in pairs]
        outputs = await self.embedding.embed(
            prompts, params, request_id, raw_request, request.priority, field=field
        )
        if outputs is None:
            return None
        scores = [pooler.score(float(o.outputs.data[0])) for o in outputs]
        return scores, sum(len(o.prompt_token_ids) for o in outputs)
