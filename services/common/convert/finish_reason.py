"""EngineCoreOutput.finish_reason (None while running, else stop / length / abort /
error) <-> engine.proto's FinishReason."""

from __future__ import annotations

from services.common.proto.pagestream.internal.v1 import engine_pb2

_TO_PB = {
    None: engine_pb2.FINISH_REASON_NONE,
    "stop": engine_pb2.FINISH_REASON_STOP,
    "length": engine_pb2.FINISH_REASON_LENGTH,
    "abort": engine_pb2.FINISH_REASON_ABORT,
    "error": engine_pb2.FINISH_REASON_ERROR,
}
_FROM_PB = {value: reason for reason, value in _TO_PB.items()}


def finish_reason_to_pb(reason: str | None) -> int:
    if reason not in _TO_PB:
        raise ValueError(f"unknown finish reason {reason!r}")
    return _TO_PB[reason]


def finish_reason_from_pb(value: int) -> str | None:
    """Raises ValueError on a value this side does not know (a newer sender's)."""
    if value not in _FROM_PB:
        raise ValueError(f"unknown FinishReason {value}")
    return _FROM_PB[value]
