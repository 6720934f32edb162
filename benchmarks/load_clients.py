"""The online benchmarks' driver: servers as child processes, streaming clients that time
every request per token (HTTP through the official `openai` client, gRPC through the
pagestream.v1.Generation stub), the closed-loop and Poisson loads, and their summary."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.results import percentiles
from benchmarks.workload import BenchRequest
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from services.common.supervisor import terminate

logger = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    sent: float
    token_times: list[float] = field(default_factory=list)  # arrivals of token-bearing messages
    end: float = 0.0
    output_tokens: int = 0
    expected_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens == self.expected_tokens


class _Client:
    """Sends a request (greedy, ignore_eos, unless `params` say otherwise; cancelled after
    `cancel_after` token-bearing messages); records its token arrivals, usage or error."""

    async def send(self, request: BenchRequest, cancel_after: int = 0, **params) -> RequestRecord:
        record = RequestRecord(sent=time.perf_counter(), expected_tokens=request.output_len)
        params = {"temperature": 0, "max_tokens": request.output_len, "ignore_eos": True, **params}
        try:
            async with contextlib.aclosing(self._stream(request, params)) as stream:
                async for has_tokens, usage in stream:  # usage: the final count
                    if has_tokens:
                        record.token_times.append(time.perf_counter())
                    if usage is not None:
                        record.output_tokens = usage
                    if cancel_after and len(record.token_times) >= cancel_after:
                        break
        except grpc.RpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"
        except Exception as exc:  # any failure is a data point, not a crash
            record.error = f"{type(exc).__name__}: {exc}"
        record.end = time.perf_counter()
        return record


class HttpClient(_Client):
    """/v1/completions with token-id prompts over SSE (`max_retries`: of failed connects)."""

    name = "HTTP"

    def __init__(self, base_url: str, max_retries: int = 0, timeout_s: float = 900) -> None:
        from openai import AsyncOpenAI

        for name in ("httpx", "httpx2"):  # one INFO line per request otherwise
            logging.getLogger(name).setLevel(logging.WARNING)
        self.client = AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key="bench", max_retries=max_retries, timeout=timeout_s
        )

    async def __aenter__(self) -> HttpClient:
        self.model = (await self.client.models.list()).data[0].id
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    async def _stream(self, request: BenchRequest, params: dict):
        stream = await self.client.completions.create(
            model=self.model,
            prompt=request.prompt_token_ids,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": params.pop("ignore_eos")},
            **params,
        )
        async for chunk in stream:
            usage = chunk.usage and chunk.usage.completion_tokens
            yield bool(chunk.choices and chunk.choices[0].text), usage


class GrpcClient(_Client):
    """pagestream.v1.Generation/Generate (server streaming) over grpc.aio."""

    name = "gRPC"

    def __init__(self, address: str, timeout_s: float = 900) -> None:
        self.address, self.timeout_s = address, timeout_s

    async def __aenter__(self) -> GrpcClient:
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()

    async def _stream(self, request: BenchRequest, params: dict):
        prompt = pb.TokenIds(token_ids=request.prompt_token_ids)
        message = pb.GenerateRequest(token_ids=prompt, sampling_params=pb.SamplingParams(**params))
        call = self.stub.Generate(message, timeout=self.timeout_s)
        try:
            async for response in call:
                usage = response.usage.completion_tokens if response.HasField("usage") else None
                yield bool(response.token_ids), usage
        finally:
            call.cancel()  # where the caller stopped reading (after the end: nothing to cancel)


async def send_all(client, requests: list[BenchRequest], concurrency=0, rate=math.inf, seed=0):
    """(records in request order, seconds): ``concurrency`` senders that each send their
    next request when their last one has ended (a closed loop), or else every request at
    its seeded Poisson arrival time (``rate`` inf: all at once, the saturated throughput)."""
    offsets = [0.0] * len(requests)
    if rate != math.inf:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(requests))
        offsets = np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()
    records: list[RequestRecord | None] = [None] * len(requests)
    queue = iter(enumerate(requests))
    start = time.perf_counter()

    async def sender() -> None:
        for index, request in queue:
            await asyncio.sleep(max(0.0, start + offsets[index] - time.perf_counter()))
            records[index] = await client.send(request)

    await asyncio.gather(*(sender() for _ in range(concurrency or len(requests))))
    return records, time.perf_counter() - start


def summarize(records: list[RequestRecord], duration_s: float, **percentile_options) -> dict:
    """Counts, throughput, and TTFT, TPOT and ITL percentiles in ms of the complete
    requests (results.percentiles' options: p50 / p99 unless told)."""
    ok = [r for r in records if r.ok]
    failures = [
        r.error or f"{r.output_tokens} of {r.expected_tokens} tokens" for r in records if not r.ok
    ]
    output_tokens = sum(r.output_tokens for r in ok)
    ms = {"scale": 1e3, **percentile_options}
    timed = [r for r in ok if r.token_times]
    tpot = [
        (r.end - r.token_times[0]) / (r.output_tokens - 1) for r in timed if r.output_tokens > 1
    ]
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failures": len(failures),
        "failure_examples": failures[:3],
        "duration_s": round(duration_s, 2),
        "requests_per_s": round(len(ok) / duration_s, 3),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / duration_s, 2),
        "ttft_ms": percentiles((r.token_times[0] - r.sent for r in timed), **ms),
        "tpot_ms": percentiles(tpot, **ms),  # the mean time per output token after the first
        "itl_ms": percentiles(
            (b - a for r in ok for a, b in itertools.pairwise(r.token_times)), **ms
        ),
    }


def figure(result: dict, path: str):
    """``result["ttft_ms"]["p50"]`` for "ttft_ms.p50"; None where it is missing."""
    for key in path.split("."):
        result = result.get(key) if isinstance(result, dict) else None
    return result


# ---- servers as child processes -----------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ChildServer:
    """A server as a child process: `command()`, waited for until `ready()`, stopped with
    SIGTERM as a user or an orchestrator would (and any children it left SIGKILLed)."""

    startup_timeout_s: float = 300.0
    env: dict[str, str] | None = None  # set in its environment (and its children's)
    quiet = False  # its output to /dev/null
    what = "the server"
    process: subprocess.Popen | None = None

    def __enter__(self):
        env = {**os.environ, **self.env} if self.env else None
        out = subprocess.DEVNULL if self.quiet else None
        self.process = subprocess.Popen(self.command(), env=env, stdout=out, stderr=out)
        try:
            wait_ready([self.process], self.ready, self.startup_timeout_s, self.what)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout_s: float = 30.0) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        children = descendants(process.pid)  # the roles of --split-services / -dp
        terminate([process], timeout_s)
        for pid in children:
            if proc_stat(pid)[:1] not in ([], ["Z"]):  # still running (a zombie has exited)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    logger.warning("killed process %d, left behind by the server", pid)


@dataclass
class ServerProcess(ChildServer):
    """`pagestream serve`, ready once /ready and grpc.health.v1 both answer."""

    model: str
    split_services: bool = False
    engine_flags: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    env: dict[str, str] | None = None

    def __post_init__(self) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.what = f"the server `{' '.join(self.command())}`"

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "pagestream.cli", "--log-level", "WARNING", "serve"]
        command += [self.model, "--grpc-port", str(self.grpc_port), "--port", str(self.http_port)]
        return command + [*self.engine_flags] + ["--split-services"] * self.split_services

    def ready(self) -> bool:
        return http_healthy(f"{self.url}/ready") and grpc_serving(self.grpc_address)

    def client(self, transport: str) -> HttpClient | GrpcClient:
        return HttpClient(self.url) if transport == "http" else GrpcClient(self.grpc_address)


def wait_ready(processes, ready, timeout_s: float, what: str) -> None:
    """Poll ``ready()``; raise when one of ``processes`` exits first or on the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError(f"{what} exited before it was ready")
        if ready():
            return
        time.sleep(0.25)
    raise TimeoutError(f"{what} was not ready within {timeout_s} s")


def proc_stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields from the state on (Linux; [] where it cannot be read)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def descendants(pid: int) -> list[int]:
    """The process ids below ``pid`` (Linux /proc; empty elsewhere)."""
    parents: dict[int, list[int]] = {}
    for path in Path("/proc").glob("[0-9]*"):
        if fields := proc_stat(path.name):
            parents.setdefault(int(fields[1]), []).append(int(path.name))
    found, todo = [], list(parents.get(pid, []))
    while todo:
        found.append(child := todo.pop())
        todo += parents.get(child, [])
    return found


def http_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def grpc_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
