"""GrpcEngineCoreClient: the EngineCoreClient protocol over one EngineCore.Connect stream.

Adds and aborts are written to the stream (`add_request` returns once the message is
sent; a rejection comes back later as an output with `error` set, which the Frontend
raises as a ValueError). `next_outputs` reads the next step's batch. A broken stream or
an unreachable engine core raises EngineUnavailableError.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.convert.engine_io import (
    engine_request_to_pb,
    outputs_from_pb,
    served_model_info_from_pb,
    stats_from_pb,
)
from services.common.engine_output import EngineCoreOutputs, SchedulerStats
from services.common.engine_request import EngineCoreRequest
from services.common.grpc_channel import aio_channel, wait_until_serving
from services.common.model_info import ServedModelInfo
from services.common.proto.pagestream.v1 import engine_pb2, engine_pb2_grpc
from services.frontend.engine_client import EngineUnavailableError

logger = logging.getLogger(__name__)

ENGINE_CORE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineCore"].full_name
_RPC_FAILURES = (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError)


class GrpcEngineCoreClient:
    def __init__(self, address: str, rpc_timeout_s: float = 30.0) -> None:
        """Create inside the running event loop; `connect` also waits for SERVING."""
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self._channel = aio_channel(address)
        self._stub = engine_pb2_grpc.EngineCoreStub(self._channel)
        self._call = None
        self._write_lock = asyncio.Lock()
        self._closed = False

    @classmethod
    async def connect(cls, address: str, timeout_s: float = 60.0) -> GrpcEngineCoreClient:
        """A client whose engine core reports SERVING, with its Connect stream open."""
        client = cls(address)
        try:
            await wait_until_serving(client._channel, ENGINE_CORE_SERVICE, timeout_s, address)
            client._stream()
        except BaseException:
            await client._channel.close()
            raise
        return client

    def _stream(self):
        if self._closed:
            raise EngineUnavailableError("the engine core client is closed")
        if self._call is None:
            self._call = self._stub.Connect()
        return self._call

    def _unavailable(self, exc: BaseException) -> EngineUnavailableError:
        if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
            detail = f"{exc.code().name}: {exc.details()}"
        else:
            detail = str(exc) or type(exc).__name__
        return EngineUnavailableError(f"the engine core at {self.address} failed: {detail}")

    async def _write(self, message: engine_pb2.EngineRequest) -> None:
        async with self._write_lock:
            try:
                await self._stream().write(message)
            except _RPC_FAILURES as exc:
                raise self._unavailable(exc) from exc

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Send the request (ValueError if its params cannot be encoded)."""
        message = engine_pb2.EngineRequest(add=engine_request_to_pb(request))
        await self._write(message)

    async def abort(self, request_ids: list[str]) -> None:
        if self._closed:
            return  # closing the stream already aborted everything
        abort = engine_pb2.AbortRequests(request_ids=request_ids)
        await self._write(engine_pb2.EngineRequest(abort=abort))

    async def next_outputs(self) -> EngineCoreOutputs:
        try:
            message = await self._stream().read()
        except _RPC_FAILURES as exc:
            raise self._unavailable(exc) from exc
        if message is grpc.aio.EOF:
            raise EngineUnavailableError(f"the engine core at {self.address} ended the stream")
        return outputs_from_pb(message)

    async def stats(self) -> SchedulerStats:
        try:
            message = await self._stub.GetStats(
                engine_pb2.GetStatsRequest(), timeout=self.rpc_timeout_s
            )
        except grpc.RpcError as exc:
            raise self._unavailable(exc) from exc
        return stats_from_pb(message)

    async def get_engine_info(self) -> ServedModelInfo:
        try:
            message = await self._stub.GetEngineInfo(
                engine_pb2.GetEngineInfoRequest(), timeout=self.rpc_timeout_s
            )
        except grpc.RpcError as exc:
            raise self._unavailable(exc) from exc
        return served_model_info_from_pb(message.model)

    async def close(self) -> None:
        """End the stream (the engine core aborts this client's requests) and the channel."""
        if self._closed:
            return
        self._closed = True
        if self._call is not None:
            self._call.cancel()
        await self._channel.close()
