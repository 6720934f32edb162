"""ModelDispatcher: the HTTP app of a multi-model serve, an ASGI app in front of one
FastAPI app per loaded model (build_app over that model's Frontend: its chat template, tool
parser, limits and errors stay its own).

A request's JSON body is read here (bounded by max_request_body_bytes), its `model` picks
the model (absent: the default one), its `keep_alive` (Ollama's) is taken out, and the body
is replayed to the model's app; the model is held (ModelRegistry lease) until that app has
sent the whole response, streamed or not. Its own routes: GET /v1/models (and /models)
with each model's `status`, POST /models/load and /models/unload (also under /v1), /health,
/ready, /metrics and /version. Every other route needs the API key here, before a model is
loaded for it (a request without the key never starts a load).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging

from fastapi.responses import JSONResponse, Response

from pagestream.models.keep_alive import parse_keep_alive
from pagestream.models.model_entry import ModelEntry, ModelState
from pagestream.models.model_registry import ModelRegistry
from pagestream.models.models_metrics import ModelsMetrics
from services.frontend.anthropic.routes import is_messages_path
from services.frontend.api_key import ApiKey
from services.frontend.metrics import CONTENT_TYPE
from services.frontend.openai.app import _error_for
from services.frontend.openai.exceptions import AuthenticationError, RequestBodyTooLargeError

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/ready", "/metrics", "/version")
LIST_PATHS = ("/v1/models", "/models")
LOAD_PATHS = ("/models/load", "/v1/models/load")
UNLOAD_PATHS = ("/models/unload", "/v1/models/unload")


class ModelDispatcher:
    def __init__(
        self, registry: ModelRegistry, api_key: str | None = None, max_body_bytes: int = 0
    ) -> None:
        self.registry = registry
        self.key = ApiKey(api_key)
        self.max_body_bytes = max_body_bytes
        self.metrics = ModelsMetrics(registry)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        try:
            if path not in OPEN_PATHS:
                self._check_key(scope)
            response = await self._own_route(scope, receive)
            if response is None:
                await self._forward(scope, receive, send)
                return
        except Exception as exc:
            response = _error_for(path, exc)
        await response(scope, receive, send)

    # ---- the dispatcher's own routes ------------------------------------------------
    async def _own_route(self, scope, receive) -> Response | None:
        method, path = scope["method"], scope["path"]
        if method == "GET":
            if path == "/health":
                return Response(status_code=200)  # alive: one failed model is not a dead server
            if path == "/ready":
                return self._ready()
            if path == "/metrics":
                return Response(await self.metrics.render(), media_type=CONTENT_TYPE)
            if path == "/version":
                return JSONResponse({"version": _version()})
            if path in LIST_PATHS:
                return JSONResponse(
                    {
                        "object": "list",
                        "data": [self._card(e) for e in self.registry.entries.values()],
                    }
                )
            if path.startswith("/v1/models/"):
                return JSONResponse(self._card(self.registry.entry(path[len("/v1/models/") :])))
        if method == "POST" and path in LOAD_PATHS + UNLOAD_PATHS:
            name = _model_field(json.loads(await self._body(scope, receive) or b"{}"))
            if name is None:
                raise ValueError("model: name the model to load or unload.")
            if path in LOAD_PATHS:
                entry = await self.registry.load(name)
            else:
                entry = await self.registry.unload(name)
            return JSONResponse({"success": True, "model": entry.name, "status": entry.status()})
        return None

    def _ready(self) -> Response:
        """Ready when every pinned model is loaded and its engine serving (the others load
        on demand, so their absence does not make the server unready)."""
        for entry in self.registry.entries.values():
            if not entry.spec.pinned:
                continue
            if entry.state is not ModelState.LOADED or not entry.model.frontend.is_ready:
                why = f"pinned model `{entry.name}` is {entry.state.value}"
                return JSONResponse({"error": why}, status_code=503)
        return Response(status_code=200)

    def _card(self, entry: ModelEntry) -> dict:
        card = {
            "id": entry.name,
            "object": "model",
            "created": 0,
            "owned_by": "pagestream",
            "root": entry.spec.args.model,
            "pinned": entry.spec.pinned,
            "status": entry.status(),
        }
        if entry.state is ModelState.LOADED:
            card["max_model_len"] = entry.model.frontend.info.max_model_len
        return card

    # ---- forwarding to a model's app ------------------------------------------------
    async def _forward(self, scope, receive, send) -> None:
        body = await self._body(scope, receive) if scope["method"] == "POST" else None
        name, keep_alive, body = _route_fields(scope, body)
        lease = await self.registry.acquire(name, keep_alive)
        try:
            await lease.model.app(_with_length(scope, body), _replay(body, receive), send)
        finally:
            lease.release()  # after the app sent the whole response (a stream too)

    async def _body(self, scope, receive) -> bytes:
        limit = self.max_body_bytes
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ConnectionError("the client went away")
            chunk = message.get("body", b"")
            size += len(chunk)
            if limit and size > limit:
                raise RequestBodyTooLargeError(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _check_key(self, scope) -> None:
        headers = dict(scope.get("headers", ()))
        if self.key.allows(headers.get(b"authorization")):
            return
        if is_messages_path(scope["path"]) and self.key.allows_x_api_key(headers.get(b"x-api-key")):
            return
        raise AuthenticationError("missing or invalid API key (Authorization: Bearer KEY).")


def _version() -> str:
    try:
        return importlib.metadata.version("pagestream")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _model_field(data) -> str | None:
    if not isinstance(data, dict):
        return None
    name = data.get("model")
    if name is not None and not isinstance(name, str):
        raise ValueError("model must be a string.")
    return name


def _route_fields(scope, body: bytes | None) -> tuple[str | None, float | None, bytes | None]:
    """(model, keep_alive, body without keep_alive) from a JSON body; a body that is not a
    JSON object goes to the default model as it is (its app says what is wrong)."""
    if not body:
        return None, None, body
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None, None, body
    name = _model_field(data)
    if not isinstance(data, dict) or "keep_alive" not in data:
        return name, None, body
    keep_alive = parse_keep_alive(data.pop("keep_alive"))
    return name, keep_alive, json.dumps(data).encode()


def _with_length(scope, body: bytes | None):
    if body is None:
        return scope
    headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    return {**scope, "headers": headers}


def _replay(body: bytes | None, receive):
    if body is None:
        return receive
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # the client's disconnect, when it comes

    return replayed
