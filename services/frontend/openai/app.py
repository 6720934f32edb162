"""The OpenAI-compatible FastAPI app over a Frontend.

Routes are thin: parse (pydantic) -> serving call -> response; every failure goes through
the one exception mapping in errors.py. With an API key, every /v1 route wants
`Authorization: Bearer KEY`; /health, /metrics, /version, /tokenize and /detokenize stay
open, as in vLLM.
"""

from __future__ import annotations

import importlib.metadata
import logging
import secrets

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.frontend.frontend import EngineUnavailableError
from services.frontend.metrics import CONTENT_TYPE, FrontendMetrics
from services.frontend.openai.errors import (
    AuthenticationError,
    ModelNotFoundError,
    OverloadedError,
    to_openai_error,
)
from services.frontend.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from services.frontend.openai.responses import ModelCard, ModelList
from services.frontend.openai.serving_chat import OpenAIServingChat
from services.frontend.openai.serving_completions import OpenAIServingCompletion
from services.frontend.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)

_MAPPED_ERRORS = (
    RequestValidationError,
    StarletteHTTPException,
    ValueError,
    ModelNotFoundError,
    AuthenticationError,
    OverloadedError,
    EngineUnavailableError,
    Exception,
)


def _version() -> str:
    try:
        return importlib.metadata.version("pagestream")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def _error_response(_request: Request, exc: Exception) -> JSONResponse:
    error = to_openai_error(exc)
    return JSONResponse(error.body(), status_code=error.status)


def _api_key_check(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
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

    @router.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[_card(state, name) for name in state.served_model_names])

    @router.get("/models/{model:path}")
    async def model(model: str) -> ModelCard:
        if model not in state.served_model_names:
            raise ModelNotFoundError(model)
        return _card(state, model)

    return router


def _card(state, name: str) -> ModelCard:
    info = state.frontend.info
    return ModelCard(id=name, root=info.model, max_model_len=info.max_model_len)


def _open_routes(app: FastAPI) -> None:
    state = app.state

    @app.get("/health")
    async def health() -> Response:
        if not state.frontend.is_healthy:
            raise EngineUnavailableError(
                f"the engine is not available: {state.frontend.dead_error}"
            )
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
        return state.tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return state.tokenization.detokenize(request)


def build_app(
    frontend,
    served_model_names: list[str],
    api_key: str | None = None,
    metrics: FrontendMetrics | None = None,
) -> FastAPI:
    """The HTTP app for one Frontend; `served_model_names` are the names clients may use
    (the first is the default when a request names none)."""
    app = FastAPI(title="pagestream", version=_version(), docs_url=None, redoc_url=None)
    state = app.state
    state.frontend = frontend
    state.served_model_names = list(served_model_names)
    state.metrics = metrics or FrontendMetrics()
    args = (frontend, state.served_model_names, state.metrics)
    state.completions = OpenAIServingCompletion(*args)
    state.chat = OpenAIServingChat(*args)
    state.tokenization = OpenAIServingTokenization(*args)
    for exc_class in _MAPPED_ERRORS:
        app.add_exception_handler(exc_class, _error_response)
    app.include_router(_v1_router(app, api_key))
    _open_routes(app)
    return app
