"""The OpenAI-compatible HTTP API over a Frontend (FastAPI + uvicorn, in-process)."""

from services.frontend.openai.app import build_app
from services.frontend.openai.http_server import HttpServer, serve_http

__all__ = ["HttpServer", "build_app", "serve_http"]
