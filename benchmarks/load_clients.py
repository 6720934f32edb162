"""Streaming clients for the serving benchmarks: one request each, timed per token, and the
closed loop that keeps a number of them in flight.

HTTP goes through the official ``openai`` client (``/v1/completions`` with token-id prompts,
``stream=True``, ``ignore_eos`` as an extra body field), gRPC through the generated
``pagestream.v1.Generation`` stub on ``grpc.aio``. Both record the send time, the arrival
time of every message that carries new tokens, the end time and the output token count
from the final usage, or the error that ended the request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import grpc

from benchmarks.workload import BenchRequest
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc


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

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if not self.token_times or self.output_tokens < 2:
            return None
        return (self.end - self.token_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive token-bearing messages."""
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


class HttpClient:
    """OpenAI-compatible completions over HTTP (SSE streaming)."""

    name = "HTTP"

    def __init__(self, base_url: str, max_retries: int = 0) -> None:
        """`max_retries`: the openai client's own retries of a request that failed to
        connect (llama-server closes kept-alive connections that the client then reuses)."""
        from openai import AsyncOpenAI

        for name in ("httpx", "httpx2"):  # one INFO line per request otherwise
            logging.getLogger(name).setLevel(logging.WARNING)
        self.client = AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key="bench", max_retries=max_retries, timeout=900
        )
        self.model: str | None = None

    async def __aenter__(self) -> HttpClient:
        models = await self.client.models.list()
        self.model = models.data[0].id
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    async def send(self, request: BenchRequest) -> RequestRecord:
        record = RequestRecord(sent=time.perf_counter(), expected_tokens=request.output_len)
        try:
            stream = await self.client.completions.create(
                model=self.model,
                prompt=request.prompt_token_ids,
                max_tokens=request.output_len,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    record.token_times.append(now)
                if chunk.usage is not None:
                    record.output_tokens = chunk.usage.completion_tokens
        except Exception as exc:  # any failure is a data point, not a crash
            record.error = f"{type(exc).__name__}: {exc}"
        record.end = time.perf_counter()
        return record


class GrpcClient:
    """pagestream.v1.Generation/Generate (server streaming) over grpc.aio."""

    name = "gRPC"

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> GrpcClient:
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def send(self, request: BenchRequest) -> RequestRecord:
        record = RequestRecord(sent=time.perf_counter(), expected_tokens=request.output_len)
        message = pb.GenerateRequest(
            token_ids=pb.TokenIds(token_ids=request.prompt_token_ids),
            sampling_params=pb.SamplingParams(
                temperature=0, max_tokens=request.output_len, ignore_eos=True
            ),
        )
        try:
            async for response in self.stub.Generate(message, timeout=900):
                now = time.perf_counter()
                if response.token_ids:
                    record.token_times.append(now)
                if response.HasField("usage"):
                    record.output_tokens = response.usage.completion_tokens
        except grpc.RpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"
        record.end = time.perf_counter()
        return record


async def closed_loop(client, requests: list[BenchRequest], concurrency: int):
    """(records in request order, seconds): ``concurrency`` senders take the requests in
    order, each sending its next one when its last one has ended."""
    records: list[RequestRecord | None] = [None] * len(requests)
    queue = iter(enumerate(requests))

    async def sender() -> None:
        for index, request in queue:
            records[index] = await client.send(request)

    start = time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(concurrency)))
    return records, time.perf_counter() - start
