"""The one place where domain errors become gRPC status codes.

Servicers wrap their methods in `@grpc_errors`: any exception escaping the method ends
the call with the status `status_for` picks. Classes are matched by name along the
exception's MRO (most specific first), so this module needs no imports from the layers
above it (scheduler, worker, frontend) and a subclass can always be given its own code.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

logger = logging.getLogger(__name__)

_CODES: dict[str, grpc.StatusCode] = {
    # Bad input: the message names the field or the problem.
    "RequestRejectedError": grpc.StatusCode.INVALID_ARGUMENT,
    "InvalidPlanError": grpc.StatusCode.INVALID_ARGUMENT,
    "ValueError": grpc.StatusCode.INVALID_ARGUMENT,
    "TypeError": grpc.StatusCode.INVALID_ARGUMENT,
    # Unknown ids.
    "KeyError": grpc.StatusCode.NOT_FOUND,
    "LookupError": grpc.StatusCode.NOT_FOUND,
    # Too much work queued (the engine core's bound on waiting requests), or a stream
    # whose client stopped reading it.
    "OverloadedError": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "EngineOverloadedError": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "SlowConsumerError": grpc.StatusCode.RESOURCE_EXHAUSTED,
    # A model of many that would not fit the memory left (the message names both figures).
    "ModelMemoryError": grpc.StatusCode.RESOURCE_EXHAUSTED,
    # A missing or wrong API key.
    "AuthenticationError": grpc.StatusCode.UNAUTHENTICATED,
    # The engine (or a service it needs) is gone.
    "EngineDeadError": grpc.StatusCode.UNAVAILABLE,
    "EngineUnavailableError": grpc.StatusCode.UNAVAILABLE,
    "ConnectionError": grpc.StatusCode.UNAVAILABLE,
    "TimeoutError": grpc.StatusCode.DEADLINE_EXCEEDED,
    "NotImplementedError": grpc.StatusCode.UNIMPLEMENTED,
}
_EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
# Conditions, not bugs: logged without a traceback (the cause is logged where it happened).
_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}


class OverloadedError(RuntimeError):
    """Too many requests in flight (RESOURCE_EXHAUSTED / HTTP 429)."""


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The status code for a domain exception (INTERNAL when nothing matches)."""
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        return exc.code()  # an upstream call failed: pass its code on
    for cls in type(exc).__mro__:
        code = _CODES.get(cls.__name__)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, details) for an exception: the details are the domain's own message."""
    code = status_code_for(exc)
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "details", None)):
        return code, exc.details() or str(exc)
    if isinstance(exc, KeyError) and exc.args:
        return code, str(exc.args[0])  # KeyError's str() adds quotes
    return code, str(exc) or type(exc).__name__


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status for `exc` (raises, as context.abort does)."""
    code, details = status_for(exc)
    if code in _EXPECTED:
        logger.info("%s: %s", code.name, details)
    elif code in _TRANSIENT:
        logger.warning("%s: %s", code.name, details)
    else:
        logger.error("%s: %s", code.name, details, exc_info=exc)
    await context.abort(code, details)


def grpc_errors(method):
    """Map exceptions escaping a servicer method (unary or streaming) to a status."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            stream = method(self, request, context)
            try:
                async for item in stream:
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_with(context, exc)
            finally:
                await stream.aclose()  # its cleanup runs now, not at garbage collection

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    return unary_wrapper
