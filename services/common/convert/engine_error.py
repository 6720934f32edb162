"""EngineCoreOutput's (error, error_code) <-> engine.proto's EngineError.

error_code None (the request itself is bad) travels as ERROR_CODE_INVALID_ARGUMENT, the
enum's zero; no error is an unset EngineError.
"""

from __future__ import annotations

from services.common.proto.pagestream.internal.v1 import engine_pb2

_TO_PB = {
    None: engine_pb2.ERROR_CODE_INVALID_ARGUMENT,
    "unavailable": engine_pb2.ERROR_CODE_UNAVAILABLE,
    "resource_exhausted": engine_pb2.ERROR_CODE_RESOURCE_EXHAUSTED,
    "internal": engine_pb2.ERROR_CODE_INTERNAL,
}
_FROM_PB = {value: code for code, value in _TO_PB.items()}


def engine_error_to_pb(error: str | None, code: str | None) -> engine_pb2.EngineError | None:
    if error is None:
        return None
    if code not in _TO_PB:
        raise ValueError(f"unknown error code {code!r}")
    return engine_pb2.EngineError(message=error, code=_TO_PB[code])


def engine_error_from_pb(message: engine_pb2.EngineError) -> tuple[str, str | None]:
    """(error, error_code); raises ValueError on a code this side does not know."""
    if message.code not in _FROM_PB:
        raise ValueError(f"unknown ErrorCode {message.code}")
    return message.message, _FROM_PB[message.code]
