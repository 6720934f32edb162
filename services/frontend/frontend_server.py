"""The frontend's gRPC server: Generation + grpc.health.v1 + reflection, with graceful stop.

Health (the whole server "" and pagestream.v1.Generation alike) is readiness: SERVING only
while the Frontend can serve (connected to an engine core that reports SERVING); over many
models (a FrontendSource of its own), SERVING while the server runs (one model that fails
to load does not make the others unreachable). With
`tls` the port speaks TLS (clients need no certificate); with `api_key` every Generation
call needs `authorization: Bearer KEY` (health and reflection stay open for probes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from services.common.grpc_server import GrpcServer, public_server_options, start_server
from services.common.proto.pagestream.v1 import generation_pb2, generation_pb2_grpc
from services.common.served_model_info import ServedModelInfo
from services.common.tls import TlsConfig
from services.frontend.api_key import ApiKey
from services.frontend.dp_engine_client import DataParallelClient
from services.frontend.engine_client import EngineCoreClient
from services.frontend.frontend import Frontend
from services.frontend.frontend_config import FrontendConfig
from services.frontend.frontend_source import FrontendSource, OneFrontend
from services.frontend.generation_service import CANCEL_TIMEOUT_S, GenerationServicer
from services.frontend.router import RouterConfig

logger = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class FrontendServer:
    """A started frontend server: `port` is the bound port (useful with port 0).

    On stop (or SIGTERM through services.common.grpc_server.serve_forever) it turns
    NOT_SERVING first, so load balancers stop sending; the server takes no new calls;
    in-flight Generate streams get the grace period to finish; whatever is left then (streams
    that ran out of time, health watchers) is cancelled at once, and cancelled streams abort
    their requests.
    """

    def __init__(self, grpc_server: GrpcServer, servicer: GenerationServicer) -> None:
        self.grpc_server = grpc_server
        self.servicer = servicer
        self.source = servicer.source
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
        """The one Frontend served (None until ready, and over many models)."""
        return self.source.frontend if isinstance(self.source, OneFrontend) else None

    async def set_serving(self, serving: bool) -> None:
        await self.grpc_server.set_serving(serving and not self._stopped)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _readiness_changed(self, ready: bool) -> None:
        if ready:
            logger.info("Generation SERVING again on %s", self.address)
        else:
            logger.error("the engine cannot serve: health NOT_SERVING")
        self._spawn(self._sync_health())

    async def _sync_health(self) -> None:
        """Health from readiness as it is now (changes may come faster than tasks run)."""
        frontend = self.frontend
        await self.set_serving(frontend is not None and frontend.is_ready)

    def _attach(self, frontend: Frontend) -> None:
        self.source.frontend = frontend
        frontend.add_readiness_listener(self._readiness_changed)

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
        self._attach(frontend)
        await self.set_serving(frontend.is_ready)
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
        # The server rejects new calls at once. Its own cancelling of the calls left comes
        # only after ours: grpc's aio core crashed (SIGSEGV) when it cancelled a
        # Generate stream that was still writing, its grace ending as ours did.
        margin = CANCEL_TIMEOUT_S + 1.0
        stopping = asyncio.get_running_loop().create_task(
            self.grpc_server.stop((grace or 0.0) + margin)
        )
        if grace:  # waits for the Generate streams only
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.servicer.drained(), grace)
        # Cancel the rest now (health watchers would otherwise hold the whole grace); our
        # own streams first, so none is still writing when the server cancels its calls.
        await self.servicer.cancel_streams()
        await self.grpc_server.server.stop(None)
        await stopping

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


async def serve_frontend(
    frontend: Frontend | Awaitable[Frontend] | FrontendSource,
    host: str = "0.0.0.0",
    port: int = 50051,
    *,
    tls: TlsConfig | None = None,
    api_key: str | None = None,
    config: FrontendConfig | None = None,
) -> FrontendServer:
    """Start Generation (+ health, reflection) on host:port; returns once it listens.

    `frontend`: a ready Frontend, or an awaitable of one (e.g. a task running
    `connect_frontend`): until it resolves, health is NOT_SERVING and calls answer
    UNAVAILABLE; or a FrontendSource over many models (each call's `model` picks one).
    Stop with `await server.stop(grace)`, or run
    `services.common.grpc_server.serve_forever(server, grace)` to stop on SIGTERM/SIGINT.
    The caller keeps owning the Frontend (close it after stopping the server). `config`:
    the frontend's limits, of which the server applies the message size and the
    concurrent calls per connection (default: the Frontend's own config, when given one).
    """
    if config is None:
        config = frontend.config if isinstance(frontend, Frontend) else FrontendConfig()
    source = frontend if isinstance(frontend, FrontendSource) else OneFrontend()
    servicer = GenerationServicer(source, ApiKey(api_key))
    grpc_server = await start_server(
        lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
        [GENERATION_SERVICE],
        host,
        port,
        tls,
        require_client_auth=False,  # the public API: any client, with the API key if set
        options=public_server_options(config.max_request_body_bytes, config.max_concurrent_streams),
    )
    grpc_server.servicer = servicer
    handle = FrontendServer(grpc_server, servicer)
    if isinstance(frontend, Frontend):
        handle._attach(frontend)
        await handle.set_serving(frontend.is_ready)
    elif isinstance(frontend, FrontendSource):
        await handle.set_serving(True)
    else:
        handle._spawn(handle._serve_when_ready(frontend))
    return handle


async def connect_frontend(
    scheduler_address: str | list[str],
    tokenizer,
    default_sampling: dict | None = None,
    *,
    timeout_s: float = 600.0,
    tls: TlsConfig | None = None,
    config: FrontendConfig | None = None,
    router: RouterConfig | None = None,
    images=None,
) -> Frontend:
    """A Frontend over the schedulers' EngineCore services (the split deployment).

    Waits (up to timeout_s) for every scheduler to report SERVING, which it does once its
    workers have loaded the model; the model facts come from the schedulers, which must
    all serve the same model. Several schedulers are data-parallel replicas behind a
    Router (`router`: its policy and thresholds). With `tls` the connections are TLS
    (mutual TLS when it has a certificate and key). Later losses of a scheduler are
    recovered from by the Frontend itself (it reconnects).
    """
    from services.frontend.grpc_engine_client import GrpcEngineCoreClient

    addresses = [scheduler_address] if isinstance(scheduler_address, str) else scheduler_address
    connecting = [GrpcEngineCoreClient.connect(a, timeout_s, tls) for a in addresses]
    results = await asyncio.gather(*connecting, return_exceptions=True)
    clients = [r for r in results if isinstance(r, GrpcEngineCoreClient)]
    try:
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        infos = await asyncio.gather(*(c.get_engine_info() for c in clients))
        _check_same_model(addresses, infos)
    except BaseException:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        raise
    logger.info("connected to the engine core(s) at %s: %s", ", ".join(addresses), infos[0].model)
    client: EngineCoreClient = clients[0]
    if len(clients) > 1:
        client = DataParallelClient(clients, router, addresses)
    return Frontend(client, tokenizer, infos[0], default_sampling, config, images)


def _check_same_model(addresses: list[str], infos: list[ServedModelInfo]) -> None:
    """Replicas must be interchangeable: same model, vocabulary, context and block size."""
    first = infos[0]
    for address, info in zip(addresses[1:], infos[1:], strict=True):
        for name in ("model", "vocab_size", "max_model_len", "block_size", "eos_token_ids"):
            if getattr(info, name) != getattr(first, name):
                raise ValueError(
                    f"the schedulers differ: {addresses[0]} serves {name}="
                    f"{getattr(first, name)!r} but {address} serves {getattr(info, name)!r}; "
                    "data-parallel replicas must run the same model and settings."
                )
