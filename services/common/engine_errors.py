"""The engine's two refusals every layer and transport shares.

The engine core raises them, its transports carry them (EngineCoreOutput.error_code over
gRPC, the exception itself in process), and the public APIs map them: unavailable to
HTTP 503 / gRPC UNAVAILABLE, overloaded to HTTP 429 / gRPC RESOURCE_EXHAUSTED.
"""

from __future__ import annotations


class EngineUnavailableError(ConnectionError):
    """The engine, or its workers, are away (reconnecting, restarting): try again shortly."""


class EngineOverloadedError(RuntimeError):
    """Too many requests wait already (max_waiting_requests): try again later."""
