"""Which executor runs the engine's workers: the one place the launch backend is chosen.

uni       the worker in this process (world size 1)
mp        tp * pp local `pagestream worker` processes, started and stopped here
external  workers someone else started, at the given addresses (rank order)
ray       tp * pp `pagestream worker` processes that Ray places (one actor per rank)

`build_executor(args, timeout_s)` is what an EngineCoreBuilder calls to get (and, after a
loss, get again) a ready executor when the engine starts its own workers.
"""

from __future__ import annotations

import logging
import sys
from functools import partial
from pathlib import Path

from pagestream.cli_flags import RankConfig, role_argv
from pagestream.engine_args import EngineArgs
from services.scheduler.executor.executor import Executor
from services.scheduler.executor.uni import UniExecutor
from services.scheduler.executor.worker_group import WorkerGroupExecutor
from services.scheduler.launchers.mp_launcher import MpLauncher
from services.scheduler.launchers.ray_launcher import RayLauncher

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 600.0


def worker_argv(
    args: EngineArgs, rank: int, rendezvous: str, ready_file: Path, cores: str | None
) -> list[str]:
    """The command line of one mp rank: a Worker service on a free loopback port, on
    `cores` (its share of the machine's) when given."""
    cli = worker_cli_args(args, rank, rendezvous, str(ready_file), "127.0.0.1", rank, cores)
    return [sys.executable, *cli]  # one machine: rank r takes CUDA device r


def ray_worker_args(args: EngineArgs, rank: int, rendezvous: str, host: str, ready_file: str):
    """The interpreter arguments of one Ray rank: bound to its node's IP (the scheduler
    may be elsewhere), local rank 0 (Ray shows each actor only its own GPU)."""
    return worker_cli_args(args, rank, rendezvous, ready_file, host, 0)


def worker_cli_args(
    args: EngineArgs,
    rank: int,
    rendezvous: str,
    ready_file: str,
    host: str,
    local_rank: int,
    cores: str | None = None,
) -> list[str]:
    """`-m pagestream.cli ... worker`: one rank's Worker service on a free port of `host`,
    writing the bound address to `ready_file`."""
    place = RankConfig(rank, local_rank, rendezvous, ready_file=ready_file, cpu_cores=cores)
    return role_argv("worker", args.model, ["--host", host, "--port", "0"], place, args)


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


def build_executor(args: EngineArgs, timeout_s: float = WORKER_START_TIMEOUT_S) -> Executor:
    """A ready executor by the launch backend of `args`: `timeout_s` bounds the wait for
    the started ranks to load their model and serve (binding their ports has its own,
    shorter bound in the launcher)."""
    parallel = args.parallel_config()
    if parallel.backend == "uni":
        from services.worker.worker import Worker

        worker = Worker(args.model_config(), args.cache_config())
        return UniExecutor(worker, 2 if args.async_scheduling else 1)
    check_parallel_model(args)
    if parallel.backend == "external":
        raise ValueError(
            "--distributed-executor-backend external needs the workers' addresses "
            "(--worker ADDR once per rank, in rank order)."
        )
    if parallel.backend == "mp":
        launcher = MpLauncher(parallel.world_size, partial(worker_argv, args))
    else:
        launcher = RayLauncher(
            parallel.world_size,
            lambda rank, rdzv, host, ready: ray_worker_args(args, rank, rdzv, host, ready),
            device=args.device,
        )
    addresses = launcher.start()
    executor = WorkerGroupExecutor.ready(addresses, args, timeout_s, launcher=launcher)
    logger.info("worker group of %d ready at %s", parallel.world_size, addresses)
    return executor
