"""One mapping from domain errors to gRPC status codes, applied by @grpc_errors."""

import grpc
import pytest

from services.common.grpc_errors import OverloadedError, grpc_errors, status_code_for, status_for
from services.scheduler.async_engine_core import EngineDeadError
from services.scheduler.scheduler import RequestRejectedError

Code = grpc.StatusCode


class EngineUnavailableError(RuntimeError):
    """Stands in for services.frontend.frontend's (matched by name, not imported)."""


class _Subclassed(RequestRejectedError):
    pass


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ValueError("temperature must be in [0, 2]"), Code.INVALID_ARGUMENT),
        (RequestRejectedError("prompt too long"), Code.INVALID_ARGUMENT),
        (_Subclassed("still a rejection"), Code.INVALID_ARGUMENT),
        (KeyError("req-1"), Code.NOT_FOUND),
        (OverloadedError("queue full"), Code.RESOURCE_EXHAUSTED),
        (EngineDeadError("loop failed"), Code.UNAVAILABLE),
        (EngineUnavailableError("gone"), Code.UNAVAILABLE),
        (ConnectionRefusedError("worker gone"), Code.UNAVAILABLE),
        (TimeoutError("slow"), Code.DEADLINE_EXCEEDED),
        (RuntimeError("a bug"), Code.INTERNAL),
    ],
)
def test_status_codes(exc, code):
    assert status_code_for(exc) == code


def test_details_are_the_domain_message():
    assert status_for(KeyError("req-1")) == (Code.NOT_FOUND, "req-1")
    assert status_for(ValueError("n must be >= 1")) == (Code.INVALID_ARGUMENT, "n must be >= 1")


class _Aborted(Exception):
    pass


class _Context:
    """Records the abort, then raises as grpc's context.abort does."""

    def __init__(self):
        self.aborted = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise _Aborted


class _Servicer:
    @grpc_errors
    async def Unary(self, request, context):
        raise RequestRejectedError(f"bad {request}")

    @grpc_errors
    async def Stream(self, request, context):
        yield 1
        raise EngineDeadError("loop failed")


async def test_the_decorator_aborts_unary_and_streaming_calls_with_the_mapped_status():
    context = _Context()
    with pytest.raises(_Aborted):
        await _Servicer().Unary("x", context)
    assert context.aborted == (Code.INVALID_ARGUMENT, "bad x")
    context, seen = _Context(), []
    with pytest.raises(_Aborted):
        async for item in _Servicer().Stream(None, context):
            seen.append(item)
    assert seen == [1] and context.aborted == (Code.UNAVAILABLE, "loop failed")
