"""Pure conversion for the public pooling RPCs (Embed, Score, Rerank, Classify): their
requests in, the Frontend's pooled outputs out as their responses.

Every invalid value raises ValueError naming the field (INVALID_ARGUMENT), before any
input is tokenized or admitted.
"""

from __future__ import annotations

from services.common.convert.pooling import pooling_params_from_pb
from services.common.outputs import PoolingRequestOutput
from services.common.pooler_config import PoolerConfig
from services.common.pooling_params import PoolingParams
from services.common.proto.pagestream.v1 import generation_pb2
from services.common.request_options import RequestOptions
from services.frontend.generation_pb import reject_unknown_fields
from services.frontend.pair_scoring import (
    PairScoring,
    check_top_n,
    pair_texts,
    query_pairs,
    rerank_order,
)
from services.frontend.request_limits import RequestLimits


def embed_inputs_from_pb(request, limits: RequestLimits) -> list[str | dict]:
    """An EmbedRequest's or ClassifyRequest's prompts, in order: text, or
    {"prompt_token_ids": [...]}."""
    reject_unknown_fields(request, type(request).__name__)
    if not request.inputs:
        raise ValueError("inputs: give at least one input to embed.")
    limits.check_prompts(len(request.inputs), param="inputs")
    prompts: list[str | dict] = []
    for i, item in enumerate(request.inputs):
        kind = item.WhichOneof("input")
        if kind == "text":
            if not item.text:
                raise ValueError(f"inputs[{i}].text is empty.")
            prompts.append(item.text)
        elif kind == "token_ids":
            prompts.append({"prompt_token_ids": list(item.token_ids.token_ids)})
        else:
            raise ValueError(f"inputs[{i}]: set text or token_ids.")
    return prompts


def embed_params_from_pb(request: generation_pb2.EmbedRequest) -> PoolingParams:
    if not request.HasField("pooling_params"):
        return PoolingParams()
    return pooling_params_from_pb(request.pooling_params)


def embed_response(
    request_id: str, outputs: list[PoolingRequestOutput]
) -> generation_pb2.EmbedResponse:
    embeddings = [
        generation_pb2.Embedding(
            values=o.outputs.data.tolist(), prompt_tokens=len(o.prompt_token_ids)
        )
        for o in outputs
    ]
    prompt_tokens = sum(e.prompt_tokens for e in embeddings)
    cached = sum(o.num_cached_tokens for o in outputs)
    usage = generation_pb2.Usage(prompt_tokens=prompt_tokens, cached_tokens=cached)
    return generation_pb2.EmbedResponse(request_id=request_id, embeddings=embeddings, usage=usage)


def optional(message, name: str):
    """A proto3 optional field's value (None: unset)."""
    return getattr(message, name) if message.HasField(name) else None


def request_options(message) -> RequestOptions:
    """An EmbedRequest's or ClassifyRequest's priority and add_special_tokens (default
    true)."""
    special = optional(message, "add_special_tokens")
    return RequestOptions(
        priority=message.priority, add_special_tokens=True if special is None else special
    )


def score_pairs_from_pb(
    request: generation_pb2.ScoreRequest, limits: RequestLimits
) -> list[tuple[str, str]]:
    reject_unknown_fields(request, "ScoreRequest")
    pairs = pair_texts(list(request.text_1), list(request.text_2))
    limits.check_prompts(len(pairs), param="text_2")
    return pairs


def rerank_pairs_from_pb(
    request: generation_pb2.RerankRequest, limits: RequestLimits
) -> list[tuple[str, str]]:
    reject_unknown_fields(request, "RerankRequest")
    pairs = query_pairs(request.query, list(request.documents))
    limits.check_prompts(len(pairs), param="documents")
    check_top_n(optional(request, "top_n"))
    return pairs


def _usage(outputs: list[PoolingRequestOutput], prompt_tokens: int) -> generation_pb2.Usage:
    cached = sum(o.num_cached_tokens for o in outputs)
    return generation_pb2.Usage(prompt_tokens=prompt_tokens, cached_tokens=cached)


def score_response(
    request_id: str, plan: PairScoring, outputs: list[PoolingRequestOutput]
) -> generation_pb2.ScoreResponse:
    return generation_pb2.ScoreResponse(
        request_id=request_id,
        scores=plan.scores(outputs),
        usage=_usage(outputs, plan.num_tokens(outputs)),
    )


def rerank_response(
    request: generation_pb2.RerankRequest,
    request_id: str,
    plan: PairScoring,
    outputs: list[PoolingRequestOutput],
) -> generation_pb2.RerankResponse:
    scores = plan.scores(outputs)
    with_text = optional(request, "return_documents") is not False
    results = [
        generation_pb2.RerankResult(
            index=i,
            relevance_score=scores[i],
            document=request.documents[i] if with_text else "",
        )
        for i in rerank_order(scores, optional(request, "top_n"))
    ]
    return generation_pb2.RerankResponse(
        request_id=request_id, results=results, usage=_usage(outputs, plan.num_tokens(outputs))
    )


def classify_response(
    request_id: str, pooler: PoolerConfig, outputs: list[PoolingRequestOutput]
) -> generation_pb2.ClassifyResponse:
    classifications = []
    for o in outputs:
        probs = pooler.probabilities(o.outputs.data)
        best = max(range(len(probs)), key=probs.__getitem__)
        classifications.append(
            generation_pb2.Classification(
                probs=probs, label=pooler.labels[best], prompt_tokens=len(o.prompt_token_ids)
            )
        )
    prompt_tokens = sum(c.prompt_tokens for c in classifications)
    return generation_pb2.ClassifyResponse(
        request_id=request_id,
        classifications=classifications,
        usage=_usage(outputs, prompt_tokens),
    )
