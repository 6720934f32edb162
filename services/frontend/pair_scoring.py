"""PairScoring: how relevant each second text is to its first, planned once for every front
door (LLM.score, HTTP /v1/score and the rerank routes, gRPC Score and Rerank).

A cross-encoder (a pooler with one label) reads each pair as its tokenizer joins them (the
second text is token type 1) and its logit through the checkpoint's activation is the
score; an embedding model embeds each distinct text once, normalized, and the score is the
cosine. The plan says what to pool (`prompts`, `params`) and turns the pooled outputs, in
that order, into scores: the caller runs the engine in between, sync or async.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.common.outputs import PoolingRequestOutput
from services.common.pooler_config import PoolerConfig
from services.common.pooling_params import PoolingParams


class ScoreInputError(ValueError):
    """A bad score or rerank input, with the request field it is in (HTTP 400 naming it,
    gRPC INVALID_ARGUMENT)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def pair_texts(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """(text_1, text_2) per score: one text_1 against every text_2, or pairwise."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in (("text_1", first), ("text_2", second)):
        _check_texts(texts, name)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ScoreInputError(
            f"text_2 has {len(second)} texts and text_1 {len(first)}: give one text_1, "
            "or as many as text_2.",
            "text_2",
        )
    return list(zip(first, second, strict=True))


def query_pairs(query: str, documents: Sequence[str]) -> list[tuple[str, str]]:
    """A rerank's (query, document) pairs, in the documents' order."""
    if not query:
        raise ScoreInputError("query must not be empty.", "query")
    _check_texts(list(documents), "documents")
    return [(query, document) for document in documents]


def check_top_n(top_n: int | None) -> None:
    if top_n is not None and top_n < 0:
        raise ScoreInputError(f"top_n must be >= 0, got {top_n}.", "top_n")


def rerank_order(scores: Sequence[float], top_n: int | None) -> list[int]:
    """The documents' indices by relevance, best first; the top_n best (0 or None: all)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[:top_n] if top_n else order


def _check_texts(texts: list[str], name: str) -> None:
    if not texts:
        raise ScoreInputError(f"{name} must not be empty.", name)
    for i, text in enumerate(texts):
        if not text:
            raise ScoreInputError(f"{name}[{i}] is empty.", name)


@dataclass(frozen=True)
class PairScoring:
    pairs: list[tuple[str, str]]
    pooler: PoolerConfig
    prompts: list[str | list[int]]  # what to pool: the distinct texts, or each pair's ids
    params: PoolingParams

    @classmethod
    def plan(
        cls,
        pairs: list[tuple[str, str]],
        pooler: PoolerConfig | None,
        tokenizer,
        truncate_prompt_tokens: int | None = None,
    ) -> PairScoring:
        if pooler is None:
            raise ScoreInputError(
                "the model runs with --runner generate: it does not score; start it with "
                "--runner pooling.",
                "model",
            )
        if pooler.num_labels > 1:
            raise ScoreInputError(
                f"the model classifies into {pooler.num_labels} labels: scores need a "
                "cross-encoder with one (or an embedding model).",
                "model",
            )
        params = _params(not pooler.num_labels, truncate_prompt_tokens)
        if pooler.num_labels:
            prompts = [tokenizer(a, b)["input_ids"] for a, b in pairs]
        else:
            prompts = list(dict.fromkeys(text for pair in pairs for text in pair))
        return cls(pairs, pooler, prompts, params)

    @property
    def cross_encoder(self) -> bool:
        return self.pooler.num_labels == 1

    def per_pair(
        self, outputs: Sequence[PoolingRequestOutput]
    ) -> list[tuple[PoolingRequestOutput, ...]]:
        """The pooled outputs of `prompts` (in order) that score each pair: the pair's own
        (a cross-encoder), or its two texts' (a bi-encoder)."""
        if self.cross_encoder:
            return [(o,) for o in outputs]
        by_text = dict(zip(self.prompts, outputs, strict=True))
        return [(by_text[a], by_text[b]) for a, b in self.pairs]

    def score(self, pooled: tuple[PoolingRequestOutput, ...]) -> float:
        """One pair's score from its per_pair outputs."""
        if self.cross_encoder:
            return self.pooler.score(float(pooled[0].outputs.data[0]))
        a, b = (np.asarray(o.outputs.data, np.float64) for o in pooled)
        return float(a @ b)

    def scores(self, outputs: Sequence[PoolingRequestOutput]) -> list[float]:
        """Each pair's score from the pooled outputs of `prompts`, in order."""
        return [self.score(pooled) for pooled in self.per_pair(outputs)]

    def num_tokens(self, outputs: Sequence[PoolingRequestOutput]) -> int:
        """The tokens read over every pair (a bi-encoder's: both texts' each time)."""
        return sum(len(o.prompt_token_ids) for pooled in self.per_pair(outputs) for o in pooled)


def classifier_pooler(pooler: PoolerConfig | None) -> PoolerConfig:
    """The engine's pooler, which must be a classifier's (its labels and their names)."""
    if pooler is None or not pooler.num_labels:
        raise ScoreInputError(
            "classification needs a classification model (*ForSequenceClassification) under "
            "--runner pooling; this one gives embeddings or generates.",
            "model",
        )
    return pooler


def classification_params(truncate_prompt_tokens: int | None) -> PoolingParams:
    """What a classification pools: the head's logits as they are."""
    return _params(False, truncate_prompt_tokens)


def _params(normalize: bool, truncate_prompt_tokens: int | None) -> PoolingParams:
    try:
        return PoolingParams(normalize=normalize, truncate_prompt_tokens=truncate_prompt_tokens)
    except ValueError as exc:
        raise ScoreInputError(str(exc), "truncate_prompt_tokens") from exc
