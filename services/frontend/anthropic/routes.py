"""The Anthropic Messages routes: POST /v1/messages and /v1/messages/count_tokens.

With an API key they want `x-api-key: KEY` (Anthropic's header) or `Authorization: Bearer
KEY`; the `anthropic-version` header is accepted and not required (one version of the API
is served). Their errors leave in Anthropic's shape: the app routes every failure under
MESSAGES_PATH through errors.to_anthropic_error (is_messages_path).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from services.frontend.anthropic.messages_request import CountTokensRequest, MessagesRequest
from services.frontend.anthropic.serving_messages import AnthropicServingMessages
from services.frontend.api_key import ApiKey
from services.frontend.openai.exceptions import AuthenticationError

__all__ = ["MESSAGES_PATH", "anthropic_router", "is_messages_path"]

MESSAGES_PATH = "/v1/messages"


def is_messages_path(path: str) -> bool:
    """Whether a request path is this API's (its errors then take Anthropic's shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def _key_check(api_key: str | None):
    key = ApiKey(api_key)

    async def check(request: Request) -> None:
        headers = request.headers
        if not (
            key.allows_x_api_key(headers.get("x-api-key"))
            or key.allows(headers.get("authorization"))
        ):
            raise AuthenticationError(
                "missing or invalid API key (x-api-key: KEY or Authorization: Bearer KEY)."
            )

    return check


def anthropic_router(state, api_key: str | None) -> APIRouter:
    """The routes over the app's chat endpoint (state.chat)."""
    router = APIRouter(prefix=MESSAGES_PATH, dependencies=[Depends(_key_check(api_key))])
    messages = AnthropicServingMessages(state.chat)

    @router.post("")
    async def create_message(request: MessagesRequest, raw_request: Request):
        return await messages.create_message(request, raw_request)

    @router.post("/count_tokens")
    async def count_tokens(request: CountTokensRequest) -> dict:
        return await messages.count_tokens(request)

    return router
