"""Which executor runs the engine's workers: the one place the launch backend is chosen.

uni       the worker in this process (world size 1)
mp        tp * pp local `pagestream worker` processes, started and stopped here
external  workers someone else started, at the given addresses (rank order)
ray       tp * pp `pagestream worker` processes that Ray places (one actor per rank)
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagestream.engine_args import EngineArgs
from services.scheduler.executor.mp import MpWorkerGroup
from services.scheduler.executor.ray_group import RayWorkerGroup
from services.scheduler.executor.uni import UniExecutor
from services.scheduler.executor.worker_group import WorkerGroupExecutor

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 600.0


@dataclass
class EngineExecutor:
    """The executor plus what must be stopped with it."""

    executor: UniExecutor | WorkerGroupExecutor
    worker: object | None = None  # the in-process Worker (uni only)
    group: MpWorkerGroup | RayWorkerGroup | None = None
    closed: bool = field(default=False)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.executor.close()
        if self.group is not None:
            self.group.close()


def worker_argv(args: EngineArgs, rank: int, rendezvous: str, ready_file: Path) -> list[str]:
    """The command line of one mp rank: a Worker service on a free loopback port."""
    cli = worker_cli_args(args, rank, rendezvous, str(ready_file), "127.0.0.1", rank)
    return [sys.executable, *cli]  # one machine: rank r takes CUDA device r


def ray_worker_args(args: EngineArgs, rank: int, rendezvous: str, host: str, ready_file: str):
    """The interpreter arguments of one Ray rank: bound to its node's IP (the scheduler
    may be elsewhere), local rank 0 (Ray shows each actor only its own GPU)."""
    return worker_cli_args(args, rank, rendezvous, ready_file, host, 0)


def worker_cli_args(
    args: EngineArgs, rank: int, rendezvous: str, ready_file: str, host: str, local_rank: int
) -> list[str]:
    """`-m pagestream.cli ... worker`: one rank's Worker service on a free port of `host`,
    writing the bound address to `ready_file`."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return [
        "-m",
        "pagestream.cli",
        "--log-level",
        level if isinstance(level, str) else "INFO",
        "worker",
        args.model,
        "--host",
        host,
        "--port",
        "0",
        "--rank",
        str(rank),
        "--local-rank",
        str(local_rank),
        "--dist-init-method",
        rendezvous,
        "--ready-file",
        ready_file,
        *args.to_cli_flags(),
    ]


def check_parallel_model(args: EngineArgs) -> None:
    """Refuse, before any process starts, a split the model cannot take (names the flag)."""
    parallel = args.parallel_config()
    if parallel.world_size == 1:
        return
    from services.common.model_source import resolve_model
    from services.worker.model_loader import load_config
    from services.worker.models.llama import check_tensor_parallel, stage_layers
    from services.worker.models.registry import native_model_class

    config = load_config(resolve_model(args.model))
    if native_model_class(getattr(config, "architectures", None)) is None:
        names = ", ".join(getattr(config, "architectures", None) or ["unknown"])
        raise ValueError(
            f"{names} runs through the transformers fallback, which supports only "
            "--tensor-parallel-size 1 and --pipeline-parallel-size 1."
        )
    check_tensor_parallel(config, parallel.tensor_parallel_size)
    stage_layers(config.num_hidden_layers, parallel.pipeline_parallel_size, 0)


def _wait_until_ready(executor: WorkerGroupExecutor, group, timeout_s: float) -> None:
    """Wait for every rank, failing at once when an mp rank's process has died."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            executor.wait_until_ready(min(2.0, max(deadline - time.monotonic(), 0.1)))
            return
        except TimeoutError:
            if group is not None:
                group.check_alive()
            if time.monotonic() >= deadline:
                raise


def build_executor(args: EngineArgs, worker_addresses: list[str] | None = None) -> EngineExecutor:
    parallel = args.parallel_config()
    depth = 2 if args.async_scheduling else 1
    if parallel.backend == "uni":
        from services.worker.worker import Worker

        worker = Worker(args.model_config(), args.cache_config())
        return EngineExecutor(UniExecutor(worker, depth), worker=worker)
    group = None
    check_parallel_model(args)
    if parallel.backend == "mp":
        group = MpWorkerGroup(
            parallel.world_size, lambda rank, rdzv, ready: worker_argv(args, rank, rdzv, ready)
        )
        worker_addresses = group.start()
    elif parallel.backend == "ray":
        group = RayWorkerGroup(
            parallel.world_size,
            lambda rank, rdzv, host, ready: ray_worker_args(args, rank, rdzv, host, ready),
            device=args.device,
        )
        worker_addresses = group.start()
    elif not worker_addresses:
        raise ValueError(
            "--distributed-executor-backend external needs the workers' addresses "
            "(--worker ADDR once per rank, in rank order)."
        )
    executor = WorkerGroupExecutor(
        worker_addresses,
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
        args.async_scheduling,
    )
    engine_executor = EngineExecutor(executor, group=group)
    try:
        _wait_until_ready(executor, group, WORKER_START_TIMEOUT_S)
    except BaseException:
        engine_executor.close()
        raise
    logger.info("worker group of %d ready at %s", parallel.world_size, worker_addresses)
    return engine_executor
