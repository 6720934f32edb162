"""GrpcEngineCoreClient: the EngineCoreClient protocol over one EngineCore.Connect stream.

Adds and aborts are written to the stream (a rejection comes back later as an output with
`error` set); `next_outputs` reads the next step's batch. A broken stream or an
unreachable engine core raises EngineUnavailableError; `reconnect` then waits until the
scheduler's EngineCore health reads SERVING again (what `ready` reports) and opens a new
stream. The channel retries a lost connection within about a second, so a restarted
scheduler is found quickly. With `tls` the channel speaks TLS (mutual with a cert and key).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from services.common.convert.engine_io import (
    engine_request_to_pb,
    outputs_from_pb,
    served_model_info_from_pb,
    stats_from_pb,
)
from services.common.convert.kv_events import kv_events_from_pb
from services.common.engine_errors import EngineUnavailableError
from services.common.engine_output import EngineCoreOutputs, SchedulerStats
from services.common.engine_request import EngineCoreRequest
from services.common.grpc_channel import RECONNECT_OPTIONS, wait_until_serving
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.kv_events import KvEventBatch
from services.common.proto.pagestream.internal.v1 import engine_pb2, engine_pb2_grpc
from services.common.served_model_info import ServedModelInfo
from services.common.tls import PLAINTEXT, TlsConfig
from services.frontend.engine_core_health import EngineCoreHealth

logger = logging.getLogger(__name__)

ENGINE_CORE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineCore"].full_name
_RPC_FAILURES = (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError)


def engine_core_channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    options = [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS]
    credentials = (tls or PLAINTEXT).channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


def engine_info_sync(channel: grpc.Channel, timeout_s: float = 30.0) -> ServedModelInfo:
    """GetEngineInfo on a blocking channel (for callers on their own threads)."""
    stub = engine_pb2_grpc.EngineCoreStub(channel)
    reply = stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=timeout_s)
    return served_model_info_from_pb(reply.model)


class GrpcEngineCoreClient:
    def __init__(
        self, address: str, rpc_timeout_s: float = 30.0, tls: TlsConfig | None = None
    ) -> None:
        """Create inside the running event loop; `connect` also waits for SERVING."""
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self._channel = engine_core_channel(address, tls)
        self._stub = engine_pb2_grpc.EngineCoreStub(self._channel)
        self.health = EngineCoreHealth(self._channel, ENGINE_CORE_SERVICE, address)
        self._call = None
        self._write_lock = asyncio.Lock()
        self._writes: set[asyncio.Future] = set()  # shielded writes whose caller may be gone
        self._kv_events_refused = False  # logged once
        self._closed = False

    @classmethod
    async def connect(
        cls, address: str, timeout_s: float = 60.0, tls: TlsConfig | None = None
    ) -> GrpcEngineCoreClient:
        """A client whose engine core reports SERVING, with its Connect stream open."""
        client = cls(address, tls=tls)
        try:
            await wait_until_serving(client._channel, ENGINE_CORE_SERVICE, timeout_s, address)
            client._call = client._stub.Connect()
            client.health.start(serving=True)
        except BaseException:
            await client._channel.close()
            raise
        return client

    @classmethod
    def open(cls, address: str, tls: TlsConfig | None = None) -> GrpcEngineCoreClient:
        """A client of an engine core already known to serve (e.g. an engine-core process
        that was waited for), its Connect stream open; create inside the running loop."""
        client = cls(address, tls=tls)
        client._call = client._stub.Connect()
        client.health.start(serving=True)
        return client

    @property
    def on_ready_change(self):
        return self.health.on_change

    @on_ready_change.setter
    def on_ready_change(self, callback) -> None:
        self.health.on_change = callback

    @property
    def ready(self) -> bool:
        return self.health.serving and not self._closed

    async def reconnect(self) -> None:
        """Drop the broken stream; once the engine core reports SERVING, open a new one."""
        self._drop_call()
        while True:  # the watch can still say SERVING of an engine core just killed
            await self.health.wait_serving()
            if self._closed:
                raise EngineUnavailableError("the engine core client is closed")
            if await self.health.confirm_serving():
                break
            await asyncio.sleep(0.1)
        self._call = self._stub.Connect()
        logger.info("connected to the engine core at %s again", self.address)

    def _drop_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    def _stream(self):
        if self._closed:
            raise EngineUnavailableError("the engine core client is closed")
        if self._call is None:
            raise EngineUnavailableError(f"reconnecting to the engine core at {self.address}")
        return self._call

    def _unavailable(self, exc: BaseException) -> EngineUnavailableError:
        if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
            detail = f"{exc.code().name}: {exc.details()}"
        else:
            detail = str(exc) or type(exc).__name__
        return EngineUnavailableError(f"the engine core at {self.address} failed: {detail}")

    async def _write(self, message: engine_pb2.EngineRequest) -> None:
        """Send one message whole, even when the caller is cancelled meanwhile: grpc.aio
        cancels the whole call when a write is cancelled, which would end every request
        on this stream (a client that hangs up while its add is on the way). The caller
        then no longer knows whether the engine core got it; the Frontend aborts it."""
        write = asyncio.ensure_future(self._write_now(message))
        self._writes.add(write)
        write.add_done_callback(self._written)
        await asyncio.shield(write)

    def _written(self, write: asyncio.Future) -> None:
        self._writes.discard(write)
        if not write.cancelled():
            write.exception()  # a caller that was cancelled meanwhile never reads it

    async def _write_now(self, message: engine_pb2.EngineRequest) -> None:
        async with self._write_lock:  # one write at a time, in the order they were asked
            try:
                await self._stream().write(message)
            except _RPC_FAILURES as exc:
                raise self._unavailable(exc) from exc

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Send the request (ValueError if its params cannot be encoded)."""
        message = engine_pb2.EngineRequest(add=engine_request_to_pb(request))
        await self._write(message)

    async def abort(self, request_ids: list[str]) -> None:
        if self._closed or self._call is None:
            return  # the stream's end (close, or its loss) aborted everything it carried
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

    async def engine_stats(self) -> dict[str, SchedulerStats]:
        return {"0": await self.stats()}

    def routing_counts(self) -> dict[tuple[str, str], int]:
        return {}  # one engine core: nothing is routed

    def release(self, request_id: str) -> None:
        """Nothing to forget: one engine core owns every request."""

    async def watch_kv_events(self) -> AsyncIterator[KvEventBatch]:
        """The engine core's prefix-cache snapshot, then its changes (waits while the
        scheduler is away; raises EngineUnavailableError when the stream breaks)."""
        call = self._stub.WatchKvEvents(engine_pb2.WatchKvEventsRequest(), wait_for_ready=True)
        try:
            async for message in call:
                yield kv_events_from_pb(message)
        except _RPC_FAILURES as exc:
            self._note_refusal(exc)
            raise self._unavailable(exc) from exc
        finally:
            call.cancel()

    def _note_refusal(self, exc: BaseException) -> None:
        """A scheduler that keeps its KV events from this frontend (--kv-events): said once,
        as a warning; the router then routes without that scheduler's cache."""
        code = getattr(exc, "code", None)
        if self._kv_events_refused or not callable(code):
            return
        if code() == grpc.StatusCode.PERMISSION_DENIED:
            self._kv_events_refused = True
            logger.warning("the engine core at %s: %s", self.address, exc.details())

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
        self._drop_call()
        await self.health.stop()
        await self._channel.close()
