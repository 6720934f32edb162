"""POST /v1/score, the rerank routes (/rerank, /v1/rerank, /v2/rerank) and /v1/classify:
how relevant a text is to another, planned by PairScoring (a cross-encoder's score of the
pair read together, or the cosine of an embedding model's embeddings), and a classifier's
label probabilities.

The score body is vLLM's (`text_1` against `text_2`: one against many, or pairwise), the rerank
body Jina's / Cohere's (`query`, `documents` as strings or {"text": ...}, `top_n`,
`return_documents`), its results by relevance, best first; the classify body vLLM's
(`input`: one or many), each result the most probable label and every label's probability.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.frontend.openai.protocol import ClassificationRequest, RerankRequest, ScoreRequest
from services.frontend.openai.replies import (
    ClassificationData,
    ClassificationResponse,
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
from services.frontend.pair_scoring import (
    PairScoring,
    check_top_n,
    classification_params,
    classifier_pooler,
    query_pairs,
    rerank_order,
)


class OpenAIServingScores:
    def __init__(self, embedding: OpenAIServingEmbedding) -> None:
        self.embedding = embedding  # scores are computed from its pooled outputs

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        model = self.embedding.check_pooling_model(request.model, "scores")
        request_id = random_id("score")
        scored = await self._scores(request.pairs(), request, request_id, raw_request, "text_2")
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
        pairs = query_pairs(request.query, documents)
        check_top_n(request.top_n)
        request_id = random_id("rerank")
        scored = await self._scores(pairs, request, request_id, raw_request, "documents")
        if scored is None:
            return Response(status_code=499)
        scores, num_tokens = scored
        order = rerank_order(scores, request.top_n)
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

    async def classify(self, request: ClassificationRequest, raw_request: Request) -> Response:
        model = self.embedding.check_pooling_model(request.model, "classification")
        pooler = classifier_pooler(self.embedding.frontend.input_processor.pooler)
        prompts = request.prompts()
        self.embedding.limits.check_prompts(len(prompts), param="input")
        for prompt in prompts:
            if isinstance(prompt, str) or request.truncate_prompt_tokens is None:
                self.embedding.check_prompt_size(prompt, "input")
        params = classification_params(request.truncate_prompt_tokens)
        request_id = random_id("classify")
        outputs = await self.embedding.embed(
            prompts, params, request_id, raw_request, request.priority, request.add_special_tokens
        )
        if outputs is None:
            return Response(status_code=499)
        data = []
        for i, output in enumerate(outputs):
            probs = pooler.probabilities(output.outputs.data)
            label = pooler.labels[max(range(len(probs)), key=probs.__getitem__)]
            data.append(
                ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs))
            )
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        body = ClassificationResponse(id=request_id, model=model, data=data, usage=usage)
        return JSONResponse(body.model_dump())

    async def _scores(
        self,
        pairs: list[tuple[str, str]],
        request: ScoreRequest | RerankRequest,
        request_id: str,
        raw_request: Request,
        field: str,
    ) -> tuple[list[float], int] | None:
        """Each pair's score and the tokens read (None: the client went away)."""
        self.embedding.limits.check_prompts(len(pairs), param=field)
        for text in dict.fromkeys(text for pair in pairs for text in pair):
            self.embedding.check_prompt_size(text, field)
        frontend = self.embedding.frontend
        plan = PairScoring.plan(
            pairs,
            frontend.input_processor.pooler,
            frontend.tokenizer,
            request.truncate_prompt_tokens,
        )
        outputs = await self.embedding.embed(
            plan.prompts, plan.params, request_id, raw_request, request.priority, field=field
        )
        if outputs is None:
            return None
        return plan.scores(outputs), plan.num_tokens(outputs)
