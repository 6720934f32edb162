"""The frontend's gRPC server: Generation + grpc.health.v1 + reflection, with graceful stop.

Health reads NOT_SERVING until the frontend is ready (and again once its engine is gone).
On stop (or SIGTERM through services.common.grpc_server.serve_forever) it turns NOT_SERVING
first, so load balancers stop sending; the server takes no new calls; in-flight Generate
streams get the grace period to finish; whatever is left then (streams that ran out of time,
health watchers) is cancelled at once, and cancelled streams abort their requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from services.common.grpc_server import GrpcServer, start_server
from services.common.proto.pagestream.v1 import generation_pb2, generation_pb2_grpc
from services.frontend.engine_client import EngineCoreClient
from services.frontend.frontend import Frontend
from services.frontend.generation_service import GenerationServicer

logger = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class FrontendServer:
    """A started frontend server: `port` is the bound port (useful with port 0)."""

    def __init__(self, grpc_server: GrpcServer, servicer: GenerationServicer) -> None:
        self.grpc_server = grpc_server
        self.servicer = servicer
        self._tasks: set[asyncio.Task] = set()
        self._ready: asyncio.Future | None = None  # the frontend, when we wrapped a coroutine
        self._stopped = False

    @property
    def port(self) -> int:
        return self.grpc_server.port

    @property
    def address(self) -> str:
        return self.grpc_server.address

    @property
    def frontend(self) -> Frontend | None:
        return self.servicer.frontend

    async def set_serving(self, serving: bool) -> None:
        await self.grpc_server.set_serving(serving and not self._stopped)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _engine_gone(self) -> None:
        logger.error("the engine is gone: health NOT_SERVING")
        self._spawn(self.set_serving(False))

    async def _serve_when_ready(self, ready: Awaitable[Frontend]) -> None:
        future = asyncio.ensure_future(ready)
        if future is not ready:
            self._ready = future  # ours: cancelled if the server stops first
        try:
            frontend = await asyncio.shield(future)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("the frontend did not become ready; health stays NOT_SERVING")
            return
        self.servicer.frontend = frontend
        await self.set_serving(frontend.is_healthy)
        logger.info("Generation SERVING on %s (model %s)", self.address, frontend.info.model)

    async def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING first, then let in-flight streams finish for `grace` seconds."""
        if self._stopped:
            return
        self._stopped = True
        for task in list(self._tasks):
            task.cancel()
        if self._ready is not None:
            self._ready.cancel()
        await self.grpc_server.health.enter_graceful_shutdown()
        logger.info("Generation stopping: draining %d stream(s)", self.servicer.num_streams)
        stopping = asyncio.get_running_loop().create_task(self.grpc_server.stop(grace))
        if grace:  # rejects new calls at once; waits for the Generate streams only
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.servicer.drained(), grace)
        # Cancel the rest now (health watchers would otherwise hold the whole grace).
        await self.grpc_server.server.stop(None)
        await stopping

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


async def serve_frontend(
    frontend: Frontend | Awaitable[Frontend],
    host: str = "0.0.0.0",
    port: int = 50051,
) -> FrontendServer:
    """Start Generation (+ health, reflection) on host:port; returns once it listens.

    `frontend`: a ready Frontend, or an awaitable of one (e.g. a task running
    `connect_frontend`): until it resolves, health is NOT_SERVING and calls answer
    UNAVAILABLE. Stop with `await server.stop(grace)`, or run
    `services.common.grpc_server.serve_forever(server, grace)` to stop on SIGTERM/SIGINT.
    The caller keeps owning the Frontend (close it after stopping the server).
    """
    servicer = GenerationServicer(None)
    grpc_server = await start_server(
        lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
        [GENERATION_SERVICE],
        host,
        port,
    )
    grpc_server.servicer = servicer
    handle = FrontendServer(grpc_server, servicer)
    servicer.on_unhealthy = handle._engine_gone
    if isinstance(frontend, Frontend):
        servicer.frontend = frontend
        await handle.set_serving(frontend.is_healthy)
    else:
        handle._spawn(handle._serve_when_ready(frontend))
    return handle


async def connect_frontend(
    scheduler_address: str,
    tokenizer,
    default_sampling: dict | None = None,
    *,
    timeout_s: float = 600.0,
) -> Frontend:
    """A Frontend over the scheduler's EngineCore service (the split deployment).

    Waits (up to timeout_s) for the scheduler to report SERVING, which it does once its
    worker has loaded the model; the model facts come from the scheduler.
    """
    from services.frontend.grpc_engine_client import GrpcEngineCoreClient

    client: EngineCoreClient = await GrpcEngineCoreClient.connect(scheduler_address, timeout_s)
    try:
        info = await client.get_engine_info()
    except BaseException:
        await client.close()
        raise
    logger.info("connected to the engine core at %s: %s", scheduler_address, info.model)
    return Frontend(client, tokenizer, info, default_sampling)
