"""WorkerGroupExecutor: the engine core's Executor over `tp * pp` Worker services.

Each plan is serialized once and the same bytes go to every rank's long-lived
Worker.Execute stream (rank order = the `--worker` order = pp_rank * tp + tp_rank); the
output rank (TP rank 0 of the last stage) answers with the sampled tokens, the others
acknowledge. One reader thread per rank collects the answers, so a rank that fails or
disappears fails the whole step (ConnectionError naming the rank and address) instead of
leaving the others waiting in a collective; a plan a rank rejects is a WorkerStepError.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from services.common.convert.step import plan_to_pb, result_from_pb
from services.common.convert.worker_info import (
    cache_description_from_pb,
    worker_description_from_pb,
)
from services.common.grpc_channel import sync_channel, wait_until_serving_sync
from services.common.proto.pagestream.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput
from services.common.tls import TlsConfig
from services.common.worker_info import CacheInfo, ModelInfo
from services.scheduler.executor.executor import WorkerStepError
from services.scheduler.launchers.launcher import Launcher

logger = logging.getLogger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
EXECUTE_METHOD = f"/{WORKER_SERVICE}/Execute"
_END = object()


def _identity(data: bytes) -> bytes:
    return data


class RankClient:
    """One rank's channel and its Execute stream (plans are pre-serialized bytes)."""

    def __init__(self, rank: int, address: str, tls: TlsConfig | None = None) -> None:
        self.rank = rank
        self.address = address
        self.channel = sync_channel(address, tls)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._execute = self.channel.stream_stream(
            EXECUTE_METHOD,
            request_serializer=_identity,
            response_deserializer=worker_pb2.StepResult.FromString,
        )
        self._plans: queue.SimpleQueue | None = None
        self.results = None  # the Execute call: an iterator of StepResults

    @property
    def name(self) -> str:
        return f"rank {self.rank} at {self.address}"

    def unary(self, method: str, request, timeout_s: float | None):
        try:
            return getattr(self.stub, method)(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise self.gone(exc) from exc

    def gone(self, exc: grpc.RpcError) -> Exception:
        code = exc.code()
        message = f"worker {self.name} failed: {code.name}: {exc.details()}"
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return ConnectionError(message)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TimeoutError(message)
        return WorkerStepError(message)

    def open_stream(self) -> None:
        self._plans = queue.SimpleQueue()
        self.results = self._execute(iter(self._plans.get, _END))

    def send(self, data: bytes) -> None:
        self._plans.put(data)

    def close_stream(self) -> None:
        if self.results is not None:
            self._plans.put(_END)
            self.results.cancel()
        self._plans = self.results = None


class GroupArgs(Protocol):
    """How the ranks are laid out (pagestream.engine_args.EngineArgs has these)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    async_scheduling: bool


@dataclass
class _Step:
    future: Future
    answers: dict[int, worker_pb2.StepResult] = field(default_factory=dict)


class WorkerGroupExecutor:
    """World size 1 is the same code with one rank (the plain `--worker ADDR` deployment).
    `launcher` (mp, ray) is what started the ranks, when the engine started them: the executor
    watches it while the ranks load and closes it with itself.
    """

    def __init__(
        self,
        addresses: list[str],
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        async_scheduling: bool = False,
        tls: TlsConfig | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        world_size = tensor_parallel_size * pipeline_parallel_size
        if len(addresses) != world_size:
            raise ValueError(
                f"--worker was given {len(addresses)} address(es), but --tensor-parallel-size "
                f"{tensor_parallel_size} x --pipeline-parallel-size {pipeline_parallel_size} "
                f"needs {world_size}, one per rank in rank order."
            )
        self.tp, self.pp = tensor_parallel_size, pipeline_parallel_size
        self.world_size = world_size
        self.output_rank = (pipeline_parallel_size - 1) * tensor_parallel_size
        self.max_concurrent_batches = pipeline_parallel_size if pipeline_parallel_size > 1 else (
            2 if async_scheduling else 1
        )  # fmt: skip
        self.ranks = [RankClient(r, address, tls) for r, address in enumerate(addresses)]
        self.launcher = launcher
        self._lock = threading.Lock()
        self._steps: dict[int, _Step] = {}
        self._step_id = 0
        self._failed: BaseException | None = None
        self._closed = False
        self._readers: list[threading.Thread] = []

    @classmethod
    def ready(
        cls,
        addresses: list[str],
        args: GroupArgs,
        timeout_s: float,
        tls: TlsConfig | None = None,
        launcher: Launcher | None = None,
    ) -> WorkerGroupExecutor:
        """An executor over the ranks at `addresses`, once every one serves (it owns
        `launcher` from here on, also when this fails)."""
        try:
            executor = cls(
                addresses,
                args.tensor_parallel_size,
                args.pipeline_parallel_size,
                args.async_scheduling,
                tls,
                launcher,
            )
        except BaseException:
            if launcher is not None:
                launcher.close()
            raise
        try:
            executor.wait_until_ready(timeout_s)
        except BaseException:
            executor.close()
            raise
        return executor

    @property
    def failed(self) -> BaseException | None:
        """Why the group failed (a rank is gone), or None; not set by close()."""
        return None if self._closed else self._failed

    @property
    def addresses(self) -> list[str]:
        return [rank.address for rank in self.ranks]

    # ---- setup calls ---------------------------------------------------------------
    def _each(self, fn) -> list:
        """fn(rank) on every rank at once (collectives inside need all ranks together)."""
        if self.world_size == 1:
            return [fn(self.ranks[0])]
        with ThreadPoolExecutor(self.world_size) as pool:
            return list(pool.map(fn, self.ranks))

    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until every rank reports SERVING (loading and joining the group); with a
        launcher, fail at once when one of its processes has died."""
        if self.launcher is None:
            self._wait_serving(timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._wait_serving(min(2.0, max(deadline - time.monotonic(), 0.1)))
                return
            except TimeoutError:
                self.launcher.check_alive()
                if time.monotonic() >= deadline:
                    raise

    def _wait_serving(self, timeout_s: float) -> None:
        self._each(
            lambda r: wait_until_serving_sync(r.channel, WORKER_SERVICE, timeout_s, r.address)
        )

    def describe(self, timeout_s: float = 60.0) -> ModelInfo:
        """The model, checked to be the same on every rank and each rank in its place."""
        request = worker_pb2.DescribeRequest()
        infos = self._each(
            lambda r: worker_description_from_pb(r.unary("Describe", request, timeout_s))
        )
        for client, info in zip(self.ranks, infos, strict=True):
            self._check_place(client, info)
            if info.model_fields() != infos[0].model_fields():
                raise ValueError(
                    f"worker {client.name} describes {info.model_fields()}, but rank 0 "
                    f"describes {infos[0].model_fields()}: every rank must run the same model"
                )
        formats = sorted({part for i in infos for part in i.quantization.split("+")} - {"none"})
        return dataclasses.replace(
            infos[self.output_rank],
            quantization="+".join(formats) or "none",
            weight_bytes=sum(info.weight_bytes for info in infos),
        )

    def _check_place(self, client: RankClient, info: ModelInfo) -> None:
        expected = (client.rank, self.world_size, self.tp, self.pp)
        got = (info.rank, info.world_size, info.tensor_parallel_size, info.pipeline_parallel_size)
        if got != expected:
            raise ValueError(
                f"worker {client.name} says it is rank {got[0]} of world size {got[1]} "
                f"(tp {got[2]}, pp {got[3]}), but the scheduler's --worker list and "
                f"--tensor-parallel-size {self.tp} / --pipeline-parallel-size {self.pp} "
                f"make it rank {expected[0]} of {expected[1]}"
            )

    def initialize_cache(
        self,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        timeout_s: float | None = None,
    ) -> CacheInfo:
        """Size the KV cache: one rank does it in one call; a group profiles every rank,
        takes the minimum and has every rank allocate exactly that."""
        limits = dict(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        if self.world_size == 1:
            message = self.ranks[0].unary(
                "InitializeCache", worker_pb2.InitializeCacheRequest(**limits), timeout_s
            )
            self._watch()
            return cache_description_from_pb(message)
        profile = worker_pb2.InitializeCacheRequest(**limits)
        profiles = self._each(lambda r: r.unary("ProfileCache", profile, timeout_s))
        allocate = worker_pb2.AllocateCacheRequest(
            **limits,
            num_device_blocks=min(p.num_device_blocks for p in profiles),
            num_cpu_blocks=min(p.num_cpu_blocks for p in profiles),
        )
        infos = self._each(lambda r: r.unary("AllocateCache", allocate, timeout_s))
        self._watch()
        logger.info(
            "worker group of %d: %d device blocks per rank (profiled %s)",
            self.world_size,
            allocate.num_device_blocks,
            [p.num_device_blocks for p in profiles],
        )
        return cache_description_from_pb(infos[self.output_rank])

    def reset(self, timeout_s: float = 60.0) -> None:
        self._each(lambda r: r.unary("Reset", worker_pb2.ResetRequest(), timeout_s))

    # ---- the step streams ----------------------------------------------------------
    def execute(self, plan: SchedulerOutput) -> Future[RunnerOutput]:
        future: Future[RunnerOutput] = Future()
        with self._lock:
            if self._failed is not None:
                future.set_exception(self._failed)
                return future
            if not self._readers:
                self._open_streams()
            self._step_id += 1
            data = plan_to_pb(plan, self._step_id).SerializeToString()
            self._steps[self._step_id] = _Step(future)
            for client in self.ranks:
                client.send(data)
        return future

    def _watch(self) -> None:
        """Open the step streams now, so a rank lost before the first step is noticed."""
        with self._lock:
            if not self._readers and self._failed is None:
                self._open_streams()

    def _open_streams(self) -> None:
        for client in self.ranks:
            client.open_stream()
            reader = threading.Thread(
                target=self._read, args=(client,), name=f"pagestream-rank{client.rank}"
            )
            reader.daemon = True
            reader.start()
            self._readers.append(reader)

    def _read(self, client: RankClient) -> None:
        try:
            for message in client.results:
                self._answer(client.rank, message)
            error: Exception = ConnectionError(f"worker {client.name} ended the Execute stream")
        except grpc.RpcError as exc:
            error = client.gone(exc)
        except Exception as exc:  # a malformed answer
            error = WorkerStepError(f"worker {client.name}: {exc!r}")
        self._fail(error)

    def _answer(self, rank: int, message: worker_pb2.StepResult) -> None:
        with self._lock:
            step = self._steps.get(message.step_id)
            if step is None:
                return  # the group already failed this step
            step.answers[rank] = message
            if len(step.answers) < self.world_size:
                return
            del self._steps[message.step_id]
        self._resolve(message.step_id, step)

    def _resolve(self, step_id: int, step: _Step) -> None:
        errors = [
            f"worker {self.ranks[rank].name} rejected step {step_id}: {answer.error}"
            for rank, answer in sorted(step.answers.items())
            if answer.error
        ]
        if errors:
            step.future.set_exception(WorkerStepError("; ".join(errors)))
            return
        try:
            step.future.set_result(result_from_pb(step.answers[self.output_rank]))
        except ValueError as exc:
            step.future.set_exception(WorkerStepError(f"malformed step {step_id} result: {exc}"))

    def _fail(self, error: BaseException) -> None:
        """A rank is gone: fail every step in flight and every later one."""
        with self._lock:
            if self._failed is None:
                self._failed = error
                logger.error("worker group failed: %s", error)
            elif not self._closed:
                logger.info("worker group: also %s", error)
            steps, self._steps = self._steps, {}
        for step in steps.values():
            if not step.future.done():
                step.future.set_exception(self._failed)

    def close(self) -> None:
        """End every rank's Execute stream (the workers drop their requests) and channel."""
        with self._lock:
            self._closed = True
            self._failed = self._failed or ConnectionError("the worker group executor is closed")
            for client in self.ranks:
                client.close_stream()
        for reader in self._readers:
            reader.join(timeout=5)
        for client in self.ranks:
            client.channel.close()
        if self.launcher is not None:
            self.launcher.close()
