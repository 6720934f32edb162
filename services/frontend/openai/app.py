"""The OpenAI-compatible FastAPI app over a Frontend.

Routes are thin: parse (pydantic) -> serving call -> response; every failure goes through
the one exception mapping in errors.py (Anthropic's routes in Anthropic's error shape,
_error_for). Request bodies over the frontend's max_request_body_bytes are refused before
they are read. Who may call what, and the probes' meaning: `build_app`.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.engine_errors import EngineOverloadedError, EngineUnavailableError
from services.frontend.api_key import ApiKey
from services.frontend.lora_options import LoRAServerOptions
from services.frontend.metrics import CONTENT_TYPE, FrontendMetrics
from services.frontend.openai.body_limit import BodyLimitMiddleware
from services.frontend.openai.errors import (
    AuthenticationError,
    ModelNotFoundError,
    OverloadedError,
    ResponseNotFoundError,
    to_openai_error,
)
from services.frontend.openai.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from services.frontend.openai.replies import ModelCard, ModelList
from services.frontend.openai.response_store import ResponseStore
from services.frontend.openai.responses_request import ResponsesRequest
from services.frontend.openai.serving_chat import OpenAIServingChat
from services.frontend.openai.serving_completions import OpenAIServingCompletion
from services.frontend.openai.serving_embedding import OpenAIServingEmbedding
from services.frontend.openai.serving_lora import OpenAIServingLoRA
from services.frontend.openai.serving_responses import OpenAIServingResponses
from services.frontend.openai.serving_score import OpenAIServingScores
from services.frontend.openai.serving_tokenization import OpenAIServingTokenization
from services.frontend.tool_options import ToolServerOptions

logger = logging.getLogger(__name__)

_MAPPED_ERRORS = (
    RequestValidationError,
    StarletteHTTPException,
    ValueError,
    ModelNotFoundError,
    ResponseNotFoundError,
    AuthenticationError,
    OverloadedError,
    EngineOverloadedError,
    EngineUnavailableError,
    Exception,
)


def _version() -> str:
    try:
        return importlib.metadata.version("pagestream")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _error_for(path: str, exc: Exception) -> JSONResponse:
    """A failure in the shape of the API the path belongs to: Anthropic's on its Messages
    routes, OpenAI's everywhere else."""
    # imported here, as in build_app: the Anthropic API is built on this package's modules
    from services.frontend.anthropic.errors import to_anthropic_error
    from services.frontend.anthropic.routes import is_messages_path

    if is_messages_path(path):
        return to_anthropic_error(exc).response()
    error = to_openai_error(exc)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _error_response(request: Request, exc: Exception) -> JSONResponse:
    return _error_for(request.url.path, exc)


def _api_key_check(api_key: str | None):
    key = ApiKey(api_key)

    async def check(request: Request) -> None:
        if not key.allows(request.headers.get("authorization")):
            raise AuthenticationError("missing or invalid API key (Authorization: Bearer KEY).")

    return check


def _v1_router(app: FastAPI, api_key: str | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(api_key))])
    state = app.state

    @router.post("/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await state.completions.create_completion(request, raw_request)

    @router.post("/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await state.chat.create_chat_completion(request, raw_request)

    @router.post("/embeddings")
    async def embeddings(request: EmbeddingRequest, raw_request: Request):
        return await state.embedding.create_embedding(request, raw_request)

    @router.post("/score")
    async def score(request: ScoreRequest, raw_request: Request):
        return await state.scores.create_score(request, raw_request)

    @router.post("/classify")
    async def classify(request: ClassificationRequest, raw_request: Request):
        return await state.scores.classify(request, raw_request)

    _rerank_route(router, state, "/rerank")

    @router.post("/responses")
    async def responses(request: ResponsesRequest, raw_request: Request):
        return await state.responses.create_response(request, raw_request)

    @router.get("/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(state.responses.retrieve(response_id))

    @router.get("/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str,
        order: Literal["asc", "desc"] = "desc",
        limit: int = Query(20, ge=1, le=100),
        after: str | None = None,
    ) -> JSONResponse:
        return JSONResponse(state.responses.input_items(response_id, order, limit, after))

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        return JSONResponse(state.responses.delete(response_id))

    _model_routes(router, state)
    return router


def _rerank_router(api_key: str | None) -> APIRouter:
    """Jina's and Cohere's paths for reranking (vLLM serves them too), behind the API key."""
    router = APIRouter(dependencies=[Depends(_api_key_check(api_key))])
    return router


def _rerank_route(router: APIRouter, state, path: str) -> None:
    @router.post(path)
    async def rerank(request: RerankRequest, raw_request: Request):
        return await state.scores.rerank(request, raw_request)


def _model_routes(router: APIRouter, state) -> None:
    """/v1/models and the LoRA adapters' load / unload routes."""

    @router.get("/models")
    async def models() -> ModelList:
        cards = [_card(state, name) for name in state.served_model_names]
        return ModelList(data=cards + state.lora.cards())

    @router.get("/models/{model:path}")
    async def model(model: str) -> ModelCard:
        if model in state.served_model_names:
            return _card(state, model)
        lora = state.lora.registry.get(model)
        if lora is None:
            raise ModelNotFoundError(model)
        return state.lora.card(lora)

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(await state.lora.load(request))

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(state.lora.unload(request))


def _card(state, name: str) -> ModelCard:
    info = state.frontend.info
    return ModelCard(
        id=name,
        root=info.model,
        max_model_len=info.max_model_len,
        speculative_decoding=info.speculative_decoding or None,
        runner=info.runner,
    )


def _open_routes(app: FastAPI) -> None:
    state = app.state

    @app.get("/health")
    async def health() -> Response:
        """Liveness: the process is up and its engine can still come back."""
        if not state.frontend.is_alive:
            raise EngineUnavailableError(state.frontend.not_ready_reason())
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: the whole chain (engine core, workers) can serve now."""
        if not state.frontend.is_ready:
            raise EngineUnavailableError(state.frontend.not_ready_reason())
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        await state.metrics.refresh(state.frontend)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return await state.tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return state.tokenization.detokenize(request)


def build_app(
    frontend,
    served_model_names: list[str],
    api_key: str | None = None,
    metrics: FrontendMetrics | None = None,
    tool_options: ToolServerOptions | None = None,
    lora: LoRAServerOptions | None = None,
) -> FastAPI:
    """The HTTP app for one Frontend; `served_model_names` are the names clients may use
    (the first is the default when a request names none), and so are the frontend's LoRA
    adapters. `tool_options`: the tool-calling and chat-template flags (tool_choice.py);
    `lora`: whether the load / unload adapter routes answer, and from which root.

    With an API key every /v1 route wants `Authorization: Bearer KEY` (compared in
    constant time; the Anthropic routes also take `x-api-key: KEY`); /health, /ready,
    /metrics, /version, /tokenize and /detokenize stay open, as in vLLM.

    Probes: GET /health is liveness (200 while this process can serve at all, even while it
    waits for its engine core or workers to come back; 503 only once its engine can never
    come back, so a restart is the cure). GET /ready is readiness (200 only while the whole
    chain can serve: the engine core connected and serving; 503 otherwise).
    """
    from services.frontend.anthropic.routes import anthropic_router  # see _error_for

    app = FastAPI(title="pagestream", version=_version(), docs_url=None, redoc_url=None)
    state = app.state
    state.frontend = frontend
    state.served_model_names = list(served_model_names)
    state.metrics = metrics or FrontendMetrics()
    args = (frontend, state.served_model_names, state.metrics)
    state.completions = OpenAIServingCompletion(*args)
    state.chat = OpenAIServingChat(*args, tool_options=tool_options)
    state.tokenization = OpenAIServingTokenization(*args)
    state.embedding = OpenAIServingEmbedding(*args)
    state.scores = OpenAIServingScores(state.embedding)
    state.lora = OpenAIServingLoRA(frontend, state.served_model_names, lora)
    state.tokenization.default_chat_template = state.chat.tool_options.chat_template
    store = ResponseStore.from_config(frontend.config)
    state.responses = OpenAIServingResponses(*args, chat=state.chat, store=store)
    for exc_class in _MAPPED_ERRORS:
        app.add_exception_handler(exc_class, _error_response)
    app.include_router(anthropic_router(state, api_key))
    app.include_router(_v1_router(app, api_key))
    reranking = _rerank_router(api_key)
    for path in ("/rerank", "/v2/rerank"):
        _rerank_route(reranking, state, path)
    app.include_router(reranking)
    _open_routes(app)
    max_bytes = frontend.config.max_request_body_bytes
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_bytes, refuse=_error_for)
    return app
