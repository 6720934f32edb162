"""EngineCoreServicer: the AsyncEngineCore over gRPC (pagestream.internal.v1.EngineCore).

Each Connect stream is one `connect()` client: AddRequest and AbortRequests come in, one
EngineOutputBatch per step (this client's requests) goes out. A request the core rejects
comes back as an output with `errors` and finish_reason "error"; the stream carries on.
A client that half-closes, cancels or goes away has its requests aborted; a dead engine
loop ends every stream with UNAVAILABLE. serve_scheduler builds the scheduler role.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from services.common.convert.engine_io import (
    engine_info_to_pb,
    engine_request_from_pb,
    outputs_to_pb,
    stats_to_pb,
)
from services.common.convert.kv_events import kv_events_to_pb
from services.common.grpc_errors import grpc_errors
from services.common.grpc_server import GrpcServer, start_server
from services.common.proto.pagestream.internal.v1 import engine_pb2, engine_pb2_grpc
from services.common.served_model_info import ServedModelInfo
from services.common.tls import TlsConfig
from services.scheduler.async_engine_core import AsyncEngineCore, refusal
from services.scheduler.engine_core_builder import EngineCoreArgs, EngineCoreBuilder
from services.scheduler.executor.worker_group import GroupArgs, WorkerGroupExecutor
from services.scheduler.kv_events_access import DEFAULT_KV_EVENTS, KvEventsAccess

logger = logging.getLogger(__name__)

RECONNECT_WAIT_S = 5.0


class SchedulerArgs(EngineCoreArgs, GroupArgs, Protocol):
    """What the scheduler role needs from pagestream.engine_args.EngineArgs."""

    kv_events: str  # who may watch the KV events (services/scheduler/kv_events_access.py)


ENGINE_CORE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineCore"].full_name
_END = object()


class EngineCoreServicer(engine_pb2_grpc.EngineCoreServicer):
    def __init__(
        self,
        core: AsyncEngineCore,
        info: ServedModelInfo,
        kv_events: KvEventsAccess = KvEventsAccess(),  # noqa: B008 (frozen: one shared value)
    ) -> None:
        self.core = core
        self.info = info
        self.kv_events = kv_events
        # Called once the engine loop has died (serve_engine_core: health NOT_SERVING).
        self.on_dead: Callable[[], Awaitable[None]] | None = None
        self._disconnects: set[asyncio.Task] = set()

    @grpc_errors
    async def Connect(self, request_iterator, context):
        client_id = self.core.connect()
        out: asyncio.Queue = asyncio.Queue()
        tasks = [
            asyncio.create_task(self._pump_outputs(client_id, out)),
            asyncio.create_task(self._read_requests(client_id, request_iterator, out)),
        ]
        try:
            while (item := await out.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield outputs_to_pb(item)
        finally:
            for task in tasks:
                task.cancel()
            # Shielded: the abort must happen even when this handler is being cancelled.
            disconnect = asyncio.create_task(self.core.disconnect(client_id))
            self._disconnects.add(disconnect)
            disconnect.add_done_callback(self._disconnects.discard)
            await asyncio.shield(disconnect)

    async def _pump_outputs(self, client_id: int, out: asyncio.Queue) -> None:
        try:
            while True:
                out.put_nowait(await self.core.outputs(client_id))
        except Exception as exc:
            if self.core.dead_error is not None and self.on_dead is not None:
                await self.on_dead()
            out.put_nowait(exc)

    async def _read_requests(self, client_id: int, requests, out: asyncio.Queue) -> None:
        """Reads ahead of the engine: each add and abort is queued for the next step as it
        arrives, so what comes while a step runs joins the next one together (awaited one
        at a time, a frontend's 128 embeddings ran 128 steps). The read is the only wait."""
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "add":
                    self._queue_add(client_id, message.add, out)
                elif kind == "abort":
                    self.core.queue_abort(client_id, list(message.abort.request_ids))
        except Exception as exc:
            out.put_nowait(exc)
        else:
            out.put_nowait(_END)  # the client closed its side

    def _queue_add(self, client_id: int, message: engine_pb2.AddRequest, out) -> None:
        try:
            request = engine_request_from_pb(message)
        except ValueError as exc:
            out.put_nowait(refusal(message.request_id, exc))
            return
        self.core.queue_add(client_id, request)  # a refusal comes back as an output

    @grpc_errors
    async def GetStats(self, request, context):
        return stats_to_pb(self.core.stats())

    @grpc_errors
    async def WatchKvEvents(self, request, context):
        """A snapshot of the prefix cache, then its changes and the load, step by step; only
        to the peers KvEventsAccess admits (the hashes tell whose prefixes are cached)."""
        refused = self.kv_events.refusal(context.peer(), context.peer_identities())
        if refused is not None:
            logger.warning("WatchKvEvents from %s refused", context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
        queue = await self.core.subscribe_kv_events()
        try:
            while (batch := await queue.get()) is not None:
                yield kv_events_to_pb(batch)
        finally:
            self.core.unsubscribe_kv_events(queue)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine core is shutting down")

    @grpc_errors
    async def GetEngineInfo(self, request, context):
        scheduler = self.core.core.scheduler
        return engine_info_to_pb(
            self.info,
            scheduler.config.max_num_seqs,
            scheduler.config.max_num_batched_tokens,
            scheduler.kv.num_cpu_blocks,
        )


async def serve_engine_core(
    core: AsyncEngineCore,
    info: ServedModelInfo,
    host: str = "127.0.0.1",
    port: int = 0,
    tls: TlsConfig | None = None,
    kv_events: str = DEFAULT_KV_EVENTS,
) -> GrpcServer:
    """Serve an engine core (over any executor) as the EngineCore service, SERVING.

    Health turns NOT_SERVING when the engine loop dies (e.g. its worker is gone).
    Stopping the server shuts the engine core's loop down. With `tls`: TLS, and mutual
    TLS when it has a CA (only frontends with a certificate from it may connect).
    `kv_events` says who may watch the KV events (KvEventsAccess).
    """
    mutual_tls = tls is not None and tls.verifies_clients  # its server requires client auth
    servicer = EngineCoreServicer(core, info, KvEventsAccess(kv_events, mutual_tls))
    server = await start_server(
        lambda s: engine_pb2_grpc.add_EngineCoreServicer_to_server(servicer, s),
        [ENGINE_CORE_SERVICE],
        host,
        port,
        tls,
        require_client_auth=True,
    )
    server.servicer = servicer
    servicer.on_dead = lambda: server.set_serving(False)
    core.on_ready = server.set_serving  # NOT_SERVING while the workers are away
    server.add_cleanup(core.shutdown)
    await server.set_serving()
    return server


async def serve_scheduler(
    worker_addresses: str | list[str],
    args: SchedulerArgs,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    worker_timeout_s: float = 600.0,
    tls: TlsConfig | None = None,
) -> GrpcServer:
    """The scheduler role over workers someone else started (one per rank, in rank
    order); while they are away a rebuild waits RECONNECT_WAIT_S for them."""
    addresses = [worker_addresses] if isinstance(worker_addresses, str) else worker_addresses
    builder = EngineCoreBuilder(
        args,
        lambda timeout_s: WorkerGroupExecutor.ready(addresses, args, timeout_s, tls),
        RECONNECT_WAIT_S,
    )
    return await serve_built_engine_core(builder, host, port, worker_timeout_s, tls)


async def serve_built_engine_core(
    builder: EngineCoreBuilder,
    host: str = "127.0.0.1",
    port: int = 0,
    worker_timeout_s: float = 600.0,
    tls: TlsConfig | None = None,
    max_rebuilds: int | None = None,
) -> GrpcServer:
    """The scheduler role over any workers: build the engine core (wait for the workers,
    size the KV cache), serve it. When the workers are lost it fails their requests,
    reports NOT_SERVING and rebuilds (with backoff) until they are back, or until
    `max_rebuilds` attempts failed (None: no limit; 0: none; the engine loop then dies).

    Stopping the server shuts the engine core down and closes the workers' executor.
    """
    core, info = await asyncio.to_thread(builder.build, worker_timeout_s)
    engine = AsyncEngineCore(core, rebuild=builder.rebuild, max_rebuilds=max_rebuilds)
    server = await serve_engine_core(engine, info, host, port, tls, builder.args.kv_events)
    server.add_cleanup(lambda: asyncio.to_thread(builder.close))  # after the core stops
    return server
