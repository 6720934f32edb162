"""GrpcExecutor: the engine core's Executor over a remote Worker service.

`execute(plan)` is called from the engine core's step thread and blocks until the
worker's StepResult arrives, so it uses grpc's blocking API: one long-lived
Worker.Execute stream whose requests are fed from a queue, answered in order. A worker
that goes away surfaces as ConnectionError naming its address; a plan the worker rejects
raises WorkerStepError (the scheduler and the worker disagree: the engine cannot go on).
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

import grpc

from services.common.convert.step import plan_to_pb, result_from_pb
from services.common.convert.worker_info import (
    cache_description_from_pb,
    worker_description_from_pb,
)
from services.common.grpc_channel import sync_channel, wait_until_serving_sync
from services.common.proto.pagestream.v1 import worker_pb2, worker_pb2_grpc
from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput
from services.common.worker_info import CacheInfo, ModelInfo

logger = logging.getLogger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
_END = object()


class WorkerStepError(RuntimeError):
    """The worker could not run a plan (its StepResult carried an error)."""


class GrpcExecutor:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = sync_channel(address)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._plans: queue.SimpleQueue | None = None
        self._results = None  # the Execute call: an iterator of StepResults
        self._step_id = 0
        self._lock = threading.Lock()

    # ---- setup calls ---------------------------------------------------------------
    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until the worker reports SERVING (it may still be loading its model)."""
        wait_until_serving_sync(self._channel, WORKER_SERVICE, timeout_s, self.address)

    def describe(self, timeout_s: float = 60.0) -> ModelInfo:
        message = self._unary(self._stub.Describe, worker_pb2.DescribeRequest(), timeout_s)
        return worker_description_from_pb(message)

    def initialize_cache(
        self,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        timeout_s: float | None = None,
    ) -> CacheInfo:
        """Size and allocate the worker's KV cache (profiling may take a while)."""
        request = worker_pb2.InitializeCacheRequest(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        message = self._unary(self._stub.InitializeCache, request, timeout_s)
        return cache_description_from_pb(message)

    def reset(self, timeout_s: float = 60.0) -> None:
        self._unary(self._stub.Reset, worker_pb2.ResetRequest(), timeout_s)

    def _unary(self, method, request, timeout_s: float | None):
        try:
            return method(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise self._gone(exc) from exc

    def _gone(self, exc: grpc.RpcError) -> Exception:
        code = exc.code()
        message = f"the worker at {self.address} failed: {code.name}: {exc.details()}"
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return ConnectionError(message)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TimeoutError(message)
        return WorkerStepError(message)

    # ---- the step stream -----------------------------------------------------------
    max_concurrent_batches = 1

    def execute(self, plan: SchedulerOutput) -> Future[RunnerOutput]:
        future: Future[RunnerOutput] = Future()
        try:
            future.set_result(self._execute(plan))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def _execute(self, plan: SchedulerOutput) -> RunnerOutput:
        with self._lock:
            self._step_id += 1
            step_id = self._step_id
            message = self._round_trip(plan_to_pb(plan, step_id))
        if message.error:
            raise WorkerStepError(f"the worker rejected step {step_id}: {message.error}")
        if message.step_id != step_id:
            raise WorkerStepError(f"expected the result of step {step_id}, got {message.step_id}")
        return result_from_pb(message)

    def _round_trip(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        if self._results is None:
            self._open_stream()
        self._plans.put(plan)
        try:
            return next(self._results)
        except grpc.RpcError as exc:
            self._close_stream()
            raise self._gone(exc) from exc
        except StopIteration:
            self._close_stream()
            raise ConnectionError(
                f"the worker at {self.address} ended the Execute stream"
            ) from None

    def _open_stream(self) -> None:
        self._plans = queue.SimpleQueue()
        self._results = self._stub.Execute(iter(self._plans.get, _END))

    def _close_stream(self) -> None:
        if self._results is not None:
            self._plans.put(_END)
            self._results.cancel()
        self._plans = self._results = None

    def close(self) -> None:
        """End the Execute stream (the worker drops its requests) and the channel."""
        with self._lock:
            self._close_stream()
        self._channel.close()
