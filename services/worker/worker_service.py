"""WorkerServicer: the Worker actor over gRPC (pagestream.internal.v1.Worker).

Thin adapters: pb -> Worker call -> pb, all on one worker thread, in order. Execute answers
one StepResult per StepPlan; a plan the worker cannot apply (any ValueError: the decoder's
checks against its PlanLimits, or its state's, raised before anything changes) gets a
StepResult whose `error` says why and the stream goes on; anything else ends the stream
(services/common/grpc_errors.py). When a stream ends the worker drops every request's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from services.common.config import CacheConfig, ModelConfig
from services.common.convert.step import plan_from_pb, result_to_pb
from services.common.convert.worker_info import (
    cache_description_to_pb,
    worker_description_to_pb,
)
from services.common.grpc_errors import grpc_errors
from services.common.grpc_server import GrpcServer, start_server
from services.common.proto.pagestream.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.rank_info import RankInfo
from services.common.tls import TlsConfig
from services.worker.parallel_state import DEFAULT_TIMEOUT_S
from services.worker.worker import Worker

logger = logging.getLogger(__name__)

GROUP_FAILED_EXIT_CODE = 75  # EX_TEMPFAIL: restart me (and my group)


def step_limits(request) -> tuple[int | None, int, int]:
    """The scheduler's limits a cache request carries (max_model_len, max_num_seqs,
    max_num_batched_tokens); the scheduler always sends the last two."""
    if request.max_num_seqs < 1 or request.max_num_batched_tokens < 1:
        raise ValueError(
            "a cache request needs max_num_seqs and max_num_batched_tokens >= 1, got "
            f"{request.max_num_seqs} and {request.max_num_batched_tokens}."
        )
    return request.max_model_len or None, request.max_num_seqs, request.max_num_batched_tokens


@dataclass(frozen=True)
class WorkerGroupRank:
    """This worker's place in its group and where the group meets (None: alone)."""

    rank: RankInfo = field(default_factory=RankInfo)
    init_method: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    local_rank: int | None = None  # CUDA device index (LOCAL_RANK)


WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerLoadingError(ConnectionError):
    """The worker is still loading its model (UNAVAILABLE: try again shortly)."""


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: Worker | None = None) -> None:
        self.worker = worker
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagestream-worker")

    async def run(self, fn, *args):
        """Run fn on the worker thread (the only thread that touches the model)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _ready(self) -> Worker:
        if self.worker is None:
            raise WorkerLoadingError("the worker is still loading its model")
        return self.worker

    @grpc_errors
    async def Describe(self, request, context):
        return worker_description_to_pb(self._ready().describe())

    @grpc_errors
    async def InitializeCache(self, request, context):
        info = await self.run(
            self._ready().initialize_cache,
            *step_limits(request),
        )
        return cache_description_to_pb(info)

    @grpc_errors
    async def ProfileCache(self, request, context):
        info = await self.run(
            self._ready().profile_cache,
            *step_limits(request),
        )
        return cache_description_to_pb(info)

    @grpc_errors
    async def AllocateCache(self, request, context):
        info = await self.run(
            self._ready().allocate_cache,
            *step_limits(request),
            request.num_device_blocks,
            request.num_cpu_blocks,
        )
        return cache_description_to_pb(info)

    @grpc_errors
    async def Execute(self, request_iterator, context):
        worker = self._ready()
        try:
            async for plan in request_iterator:
                yield await self.run(_execute_step, worker, plan)
        finally:
            # Queued behind any step still running; not awaited (we may be cancelled).
            # RuntimeError: the server is shutting down and the thread is gone already.
            with contextlib.suppress(RuntimeError):
                self._thread.submit(worker.reset)

    @grpc_errors
    async def Reset(self, request, context):
        await self.run(self._ready().reset)
        return worker_pb2.ResetResponse()

    async def close(self) -> None:
        await asyncio.to_thread(self._thread.shutdown, True)
        if self.worker is not None:  # its KV offload files written before the process ends
            await asyncio.to_thread(self.worker.close)


def _execute_step(worker: Worker, message: worker_pb2.StepPlan) -> worker_pb2.StepResult:
    """One plan on the worker thread: convert, run, convert back."""
    try:
        result = worker.execute(plan_from_pb(message, worker.plan_limits))
    except ValueError as exc:
        logger.warning("step %d rejected: %s", message.step_id, exc)
        return worker_pb2.StepResult(step_id=message.step_id, error=str(exc) or repr(exc))
    except Exception:
        if worker.rank.world_size > 1:
            _leave_group(message.step_id)
        raise
    return result_to_pb(result, message.step_id)


def _leave_group(step_id: int) -> None:
    """A rank of a worker group failed mid-step (a peer is gone, a collective broke): its
    process group cannot be mended, so this process exits and the group restarts whole
    (by its supervisor, compose or Kubernetes); the scheduler reconnects when it is back."""
    logger.critical(
        "step %d failed on this rank of a worker group: exiting", step_id, exc_info=True
    )
    logging.shutdown()
    os._exit(GROUP_FAILED_EXIT_CODE)


async def start_worker_server(
    host: str = "127.0.0.1", port: int = 0, tls: TlsConfig | None = None
) -> GrpcServer:
    """Bind and serve, NOT_SERVING and without a model yet (see load_worker). With `tls`
    the port speaks TLS, and mutual TLS when it has a CA (only the scheduler may drive it)."""
    servicer = WorkerServicer()
    server = await start_server(
        lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
        [WORKER_SERVICE],
        host,
        port,
        tls,
        require_client_auth=True,
    )
    server.servicer = servicer
    server.add_cleanup(servicer.close)
    return server


async def load_worker(
    server: GrpcServer,
    model_config: ModelConfig,
    cache_config: CacheConfig,
    group: WorkerGroupRank | None = None,
) -> Worker:
    """Join the worker group (if any) and load the model on the worker thread, then
    report SERVING."""
    servicer: WorkerServicer = server.servicer
    group = group or WorkerGroupRank()
    worker = await servicer.run(
        Worker,
        model_config,
        cache_config,
        group.rank,
        group.init_method,
        group.timeout_s,
        group.local_rank,
    )
    servicer.worker = worker
    await server.set_serving()
    logger.info("worker ready: %s on %s", model_config.model, worker.device)
    return worker


async def serve_worker(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    group: WorkerGroupRank | None = None,
    tls: TlsConfig | None = None,
) -> GrpcServer:
    """A Worker service on host:port (0: any free port), returned once SERVING.

    Health is NOT_SERVING while the model loads. Stop it with `await server.stop(grace)`.
    """
    server = await start_worker_server(host, port, tls)
    try:
        await load_worker(server, model_config, cache_config, group)
    except BaseException:
        await server.stop(0)
        raise
    return server
